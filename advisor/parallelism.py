"""Several GPUs: the value types of how the ranks share the model. A leaf: it imports no backend.

`Strategy` is what accelerate launches (DDP, FSDP2, DeepSpeed ZeRO-2 / ZeRO-3) and `Parallelism` one strategy with
FSDP2's resharding after forward and CPU offload of parameters / optimizer state (`problems()`: what cannot run as
written). `Layout` is the `parallelism` knob of a Candidate (advisor/knobs.py, written to the accelerate config by
advisor/accelerate_config.py): one value per valid combination, so the search explores one categorical;
`search_layouts` are those the default space explores on N GPUs and `layout_problems` why a layout cannot run on
N. `accumulation_for` splits an effective batch over the ranks. What one rank holds and how fast it runs is
predicted by the backends: the simulator's `advisor.simulator.simulate_per_rank` (FSDP2 on fake tensors), the
closed forms both backends share in advisor/physics/ranks_closed.py (ZeRO's model states, the collectives' time,
the estimate's rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from . import packages
from .errors import ConfigError

__all__ = ["Strategy", "Parallelism", "Layout", "layout_problems", "search_layouts", "deepspeed_available",
           "accumulation_for"]


class Strategy(str, Enum):
    """How the ranks share the model (accelerate's distributed types)."""

    DDP = "ddp"  # every rank holds the whole model; gradients all-reduced
    FSDP2 = "fsdp2"  # torch's fully_shard through accelerate (fsdp_version: 2)
    ZERO2 = "zero2"  # DeepSpeed ZeRO stage 2: optimizer state and gradients partitioned
    ZERO3 = "zero3"  # DeepSpeed ZeRO stage 3: parameters too

    @property
    def deepspeed(self) -> bool:
        return self in (Strategy.ZERO2, Strategy.ZERO3)


@dataclass(frozen=True)
class Parallelism:
    """One strategy and its settings: what a `Layout` value stands for."""

    strategy: Strategy = Strategy.FSDP2
    reshard_after_forward: bool = True  # FSDP2 (ZeRO-3's equivalent is always on)
    offload_params: bool = False  # FSDP2's CPUOffloadPolicy / ZeRO-3's offload_param
    offload_optimizer: bool = False  # ZeRO's offload_optimizer; FSDP2 offloads both or neither

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            try:
                object.__setattr__(self, "strategy", Strategy(self.strategy))
            except ValueError:
                raise ConfigError(
                    f"parallelism={self.strategy!r} (--parallelism): not a strategy; use one of "
                    f"{', '.join(s.value for s in Strategy)}"
                ) from None

    def problems(self, num_gpus: int = 1) -> list[str]:
        """What cannot run as written, each naming the knob and the fix (the world size: workload.check_world)."""
        out: list[str] = []
        if self.strategy.deepspeed and not deepspeed_available():
            out.append(
                f"parallelism={self.strategy.value} (--parallelism): DeepSpeed ZeRO needs the `deepspeed` package, "
                "which is not installed; `pip install advisor[deepspeed]`, or use fsdp2"
            )
        if self.strategy is Strategy.DDP and (self.offload_params or self.offload_optimizer):
            out.append("offload_params / offload_optimizer (--offload-params / --offload-optimizer): DDP offloads "
                       "nothing; use fsdp2 or zero3 to offload")
        if self.strategy is Strategy.FSDP2 and self.offload_params != self.offload_optimizer:
            out.append("offload_params / offload_optimizer: FSDP2's CPUOffloadPolicy moves parameters, gradients "
                       "and optimizer state together; set both (or use zero2/zero3 for optimizer-only offload)")
        if self.strategy is Strategy.ZERO2 and self.offload_params:
            out.append("offload_params (--offload-params): ZeRO-2 does not partition parameters, so it cannot "
                       "offload them; use zero3, or offload the optimizer only")
        if self.strategy is not Strategy.FSDP2 and not self.reshard_after_forward:
            out.append("reshard_after_forward=False (--no-reshard-after-forward) is an FSDP2 setting; use fsdp2")
        return out

    def check(self, num_gpus: int = 1) -> None:
        problems = self.problems(num_gpus)
        if problems:
            raise ConfigError(problems, context="parallelism")


class Layout(str, Enum):
    """The `parallelism` knob of a Candidate (advisor/knobs.py): one value per valid combination of `Parallelism`'s
    fields, so the search explores one categorical and every value can run. DDP, the default, shards nothing: on
    one GPU it is the single-GPU run (memory-neutral, left out of study keys)."""

    DDP = "ddp"
    FSDP2 = "fsdp2"  # reshard after forward
    FSDP2_NO_RESHARD = "fsdp2_no_reshard"  # keep the gathered parameters from forward to backward
    FSDP2_OFFLOAD = "fsdp2_offload"  # CPUOffloadPolicy: parameters, gradients and optimizer state on the host
    ZERO2 = "zero2"
    ZERO2_OFFLOAD_OPTIMIZER = "zero2_offload_optimizer"
    ZERO3 = "zero3"
    ZERO3_OFFLOAD_OPTIMIZER = "zero3_offload_optimizer"
    ZERO3_OFFLOAD = "zero3_offload"  # parameters and optimizer state on the host

    @property
    def parallelism(self) -> Parallelism:
        return _LAYOUTS[self]

    @property
    def deepspeed(self) -> bool:
        return self.parallelism.strategy.deepspeed


_LAYOUTS: dict[Layout, Parallelism] = {
    Layout.DDP: Parallelism(Strategy.DDP),
    Layout.FSDP2: Parallelism(Strategy.FSDP2),
    Layout.FSDP2_NO_RESHARD: Parallelism(Strategy.FSDP2, reshard_after_forward=False),
    Layout.FSDP2_OFFLOAD: Parallelism(Strategy.FSDP2, offload_params=True, offload_optimizer=True),
    Layout.ZERO2: Parallelism(Strategy.ZERO2),
    Layout.ZERO2_OFFLOAD_OPTIMIZER: Parallelism(Strategy.ZERO2, offload_optimizer=True),
    Layout.ZERO3: Parallelism(Strategy.ZERO3),
    Layout.ZERO3_OFFLOAD_OPTIMIZER: Parallelism(Strategy.ZERO3, offload_optimizer=True),
    Layout.ZERO3_OFFLOAD: Parallelism(Strategy.ZERO3, offload_params=True, offload_optimizer=True),
}


def layout_problems(layout: Layout, num_gpus: int) -> list[str]:
    """Why `layout` cannot run on `num_gpus` GPUs here, each naming the knob and the fix."""
    if num_gpus == 1 and layout is not Layout.DDP:
        return [f"parallelism={layout.value}: shards over several GPUs; give --num-gpus N (N > 1), or drop the "
                "--fix parallelism"]
    if num_gpus == 1:
        return []
    return [p.replace("(--parallelism)", "(--fix parallelism)") for p in layout.parallelism.problems(num_gpus)]


def search_layouts(num_gpus: int) -> tuple[Layout, ...]:
    """The layouts the default search explores on `num_gpus` GPUs: DDP alone on one; FSDP2's three and, where
    DeepSpeed is importable, ZeRO's five on several."""
    if num_gpus <= 1:
        return (Layout.DDP,)
    out = [Layout.DDP, Layout.FSDP2, Layout.FSDP2_NO_RESHARD, Layout.FSDP2_OFFLOAD]
    if deepspeed_available():
        out += [Layout.ZERO2, Layout.ZERO2_OFFLOAD_OPTIMIZER, Layout.ZERO3, Layout.ZERO3_OFFLOAD_OPTIMIZER,
                Layout.ZERO3_OFFLOAD]
    return tuple(out)


def deepspeed_available() -> bool:
    """DeepSpeed is an optional extra (`pip install advisor[deepspeed]`)."""
    return packages.installed("deepspeed")


def accumulation_for(global_rows: int, per_device_rows: int, num_gpus: int) -> int:
    """The gradient accumulation that makes `global_rows` rows a step from `per_device_rows` on each of `num_gpus`
    ranks; ConfigError naming the flags when the effective batch cannot be split over the ranks."""
    share = per_device_rows * num_gpus
    if share <= 0 or global_rows % share:
        raise ConfigError(
            f"an effective batch of {global_rows} rows cannot be split over --num-gpus {num_gpus} with "
            f"per_device_train_batch_size={per_device_rows}: it must be a multiple of {share}; change the "
            "effective batch (--tokens-per-step), the micro-batch or --num-gpus",
            context="parallelism",
        )
    return global_rows // share
