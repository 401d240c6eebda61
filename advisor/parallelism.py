"""Several GPUs (issue 16): the parallelism knobs, one rank's simulation, and the split of the effective batch.

`Parallelism` holds the multi-GPU knobs beside a `Candidate` (kept apart from it until the knob registry of
advisor/space.py takes them): the strategy accelerate launches (DDP, FSDP2, DeepSpeed ZeRO-2 / ZeRO-3), FSDP2's
resharding after forward, and CPU offload of parameters / optimizer state. `simulate_per_rank` predicts one rank's
memory and the global throughput (advisor/_sim/distributed.py); `advisor.accelerate_config` emits the launch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .measurement import Measurement
    from .space import Candidate
    from .workload import Workload

__all__ = ["Strategy", "Parallelism", "Layout", "deepspeed_available", "simulate_per_rank", "estimate_per_rank",
           "rank_step_time", "accumulation_for", "shard_fsdp2"]


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
    """The multi-GPU knobs of one candidate (held beside the Candidate until the knob registry takes them)."""

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
    return importlib.util.find_spec("deepspeed") is not None


def simulate_per_rank(workload: Workload, candidate: Candidate, num_gpus: int | None = None,
                      parallelism: Parallelism | None = None, **kwargs) -> Measurement:
    """One rank's peak / reserved / device bytes and the global trained tokens per second of `candidate` on
    `num_gpus` GPUs (default: the workload's); see advisor/_sim/distributed.simulate_per_rank for the keywords."""
    from ._sim import simulate_per_rank as run

    return run(workload, candidate, num_gpus, parallelism, **kwargs)


def shard_fsdp2(model: Any, mesh: Any, parallelism: Parallelism, precision: str) -> Any:
    """Shard a real model over a real process group's `mesh` exactly as the simulation shards its fake one
    (accelerate's own `fsdp2_prepare_model`; the CPU probe of several ranks uses it, since accelerate's FSDP path
    refuses a CPU process group)."""
    from ._sim import prepare_fsdp2

    return prepare_fsdp2(model, mesh, parallelism, precision)


def estimate_per_rank(workload: Workload, candidate: Candidate, moments: dict, parts: object) -> tuple[dict, list[str]]:
    """The estimate's moments of one rank (advisor/estimator.py calls this when the workload has several GPUs)."""
    from ._sim import estimate_rank_moments

    return estimate_rank_moments(workload, candidate, moments, parts)


def rank_step_time(workload: Workload, candidate: Candidate, step_s: float,
                   trained_per_step: int) -> tuple[float, int, float, str]:
    """(step seconds with the collectives' exposed time, global trained tokens per step, exposed seconds, note)."""
    from ._sim import estimate_rank_time

    return estimate_rank_time(workload, candidate, step_s, trained_per_step)


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
