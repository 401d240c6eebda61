"""The host's cost per dispatched op, measured on the machine that runs the advisor (the package docstring: "Host and
device as two queues").

Eager PyTorch spends host time on every op it dispatches: the Python of the module that calls it (transformers'
modeling code), the dispatcher, autograd's recording of the node, the allocator. That cost depends on the host and on
the library versions, not on the GPU, so it is measured here by a microbenchmark of eager dispatch, not assumed:

- a small Llama decoder from transformers (its own modeling code: the Python a real step runs), on tensors so small
  that the kernels take no measurable time, runs its forward without autograd, its forward with autograd (a loss on
  labels) and its backward, each timed over many repetitions (the median);
- the ops of each pass are counted by a dispatch mode (a separate, untimed pass) and classed as the timing hook
  classes them (`op_class`): NOGRAD (issued from Python with grad off: a no-grad forward, generate, the optimizer's
  for-loop), GRAD (issued from Python with grad on: the forward of a trained model, its loss, a checkpointed
  recompute) and BACKWARD (issued by autograd's engine);
- per op of a class: the time of its pass (the 10th percentile of the repetitions: the cost itself, not what other
  processes on a shared machine add to it) over the ops it dispatched (the Python around them included: what the op
  costs the host as transformers' code issues it);
- LOOP: torch's own Python loops over tensors (AdamW's for-loop step, `clip_grad_norm_` without foreach): one
  for-loop AdamW step over the same model's parameters, its time over its ops.

The result is cached per host, Python, torch and transformers version under the advisor's cache directory
(`$ADVISOR_CACHE_DIR/host_cost/`). `ADVISOR_HOST_COST` (JSON: {"nograd_us": .., "grad_us": .., "backward_us": ..,
"loop_us": ..})
pins it instead (tests, or a user who measured their training host elsewhere). On a CUDA target each op that launches
a kernel also pays the CUDA launch (time_constants.json `host.cuda_launch_us`, with its source); the host measured
here stands in for the target's host when the target is remote.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from enum import IntEnum
from functools import lru_cache
from pathlib import Path

from ..._files import cache_dir, write_atomic
from ...errors import ConfigError

ENV = "ADVISOR_HOST_COST"


class OpClass(IntEnum):
    """How a dispatched op reaches the dispatcher (what its host cost depends on)."""

    NOGRAD = 0  # issued from Python with grad off
    GRAD = 1  # issued from Python with grad on (autograd records what needs it)
    BACKWARD = 2  # issued by autograd's engine in the backward


@dataclass(frozen=True)
class HostCost:
    """Seconds of host time per dispatched op, by OpClass, and where they come from."""

    nograd_s: float
    grad_s: float
    backward_s: float
    loop_s: float  # one op of torch's own Python loop over tensors (the for-loop optimizer, clipping)
    host: str  # the machine measured
    measured: str  # ISO date of the measurement ("" when pinned)
    versions: str  # python / torch / transformers measured with
    source: str  # "microbenchmark", or the variable that pinned it

    def per_op(self, cls: OpClass) -> float:
        return (self.nograd_s, self.grad_s, self.backward_s)[int(cls)]

    @property
    def label(self) -> str:
        """What the report says of it."""
        if self.source != "microbenchmark":
            return f"host cost per op pinned by {self.source}"
        return f"host cost per op measured on {self.host}, {self.measured} ({self.versions})"


def op_class() -> OpClass:
    """The class of the op being dispatched now (call it from a dispatch mode): a checkpointed layer's recompute runs
    inside the engine with grad on, as the forward it repeats."""
    import torch  # lazy: loads torch

    if torch.is_grad_enabled():
        return OpClass.GRAD
    if torch._C._current_autograd_node() is not None:
        return OpClass.BACKWARD
    return OpClass.NOGRAD


# ---- the host this process runs on ----------------------------------------------------------------------------------

def host_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()} ({cpu})"


def _versions() -> str:
    import torch  # lazy: loads torch
    import transformers  # lazy: loads transformers

    return f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"


def _cache_path() -> Path:
    key = re.sub(r"[^A-Za-z0-9.]+", "-", f"{socket.gethostname()}-{_versions()}").strip("-")
    return cache_dir() / "host_cost" / f"{key}.json"


# ---- the microbenchmark ---------------------------------------------------------------------------------------------

def _bench_model(device: str = "cpu"):
    import torch  # lazy: loads torch
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: loads transformers

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    model.train()
    ids = torch.randint(0, 64, (2, 8), device=device)
    return model, ids


def _counted(run) -> list[int]:
    """Ops per OpClass that `run()` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode  # lazy: loads torch

    counts = [0, 0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[int(op_class())] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return counts


def _low(times: list[float]) -> float:
    """The 10th percentile: what a repetition costs when nothing else runs on the machine."""
    return statistics.quantiles(times, n=10)[0]


def measure(repeats: int = 60, device: str = "cpu") -> HostCost:
    """Run the microbenchmark (about a second) and return what it measured (the module docstring). On a CUDA
    `device` each pass ends with a sync (the kernels are tiny: the pass is the host's issue time, launches
    included)."""
    import torch  # lazy: loads torch
    from torch.utils._python_dispatch import _disable_current_modes  # lazy: loads torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with _disable_current_modes(), torch.enable_grad():
        model, ids = _bench_model(device)

        def nograd():
            with torch.no_grad():
                model(input_ids=ids)

        def forward():
            return model(input_ids=ids, labels=ids).loss

        for _ in range(20):
            nograd()
            forward().backward()
        n_nograd = _counted(nograd)
        holder: list = []
        n_fwd = _counted(lambda: holder.append(forward()))
        n_bwd = _counted(lambda: holder.pop().backward())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)
        forward().backward()
        opt.step()
        n_loop = _counted(opt.step)
        t_nograd, t_fwd, t_bwd, t_loop = [], [], [], []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            nograd()
            sync()
            t1 = time.perf_counter()
            loss = forward()
            sync()
            t2 = time.perf_counter()
            loss.backward()
            sync()
            t3 = time.perf_counter()
            opt.step()
            sync()
            t_loop.append(time.perf_counter() - t3)
            t_nograd.append(t1 - t0)
            t_fwd.append(t2 - t1)
            t_bwd.append(t3 - t2)
        model.zero_grad(set_to_none=True)
    nograd = _low(t_nograd) / max(1, sum(n_nograd))
    grad = _low(t_fwd) / max(1, sum(n_fwd))
    backward = _low(t_bwd) / max(1, sum(n_bwd))
    loop = _low(t_loop) / max(1, sum(n_loop))
    return HostCost(nograd_s=nograd, grad_s=grad, backward_s=backward, loop_s=loop, host=host_name(),
                    measured=time.strftime("%Y-%m-%d"), versions=_versions(), source="microbenchmark")


# ---- the cost this process uses ------------------------------------------------------------------------------------

def _pinned(text: str) -> HostCost:
    fix = (f"{ENV}={text!r}: expected JSON with the host's seconds per op in microseconds, e.g. "
           f'{{"nograd_us": 8, "grad_us": 10, "backward_us": 3, "loop_us": 1.5}}; or unset it to measure this host')
    try:
        data = json.loads(text)
        values = [float(data[k]) for k in ("nograd_us", "grad_us", "backward_us", "loop_us")]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(fix, context=ENV) from exc
    if any(not v > 0 for v in values):
        raise ConfigError(fix + " (each must be positive)", context=ENV)
    return HostCost(*(v * 1e-6 for v in values), host=str(data.get("host", "pinned")), measured="",
                    versions="", source=ENV)


def _read(path: Path) -> HostCost | None:
    try:
        data = json.loads(path.read_text())
        return HostCost(**data)
    except (OSError, ValueError, TypeError):
        return None


def _write(path: Path, cost: HostCost) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(cost), indent=1) + "\n")
    except OSError:  # an unwritable cache: measured again next time, never an error
        pass


@lru_cache(maxsize=4)
def _resolved(pinned: str | None) -> HostCost:
    if pinned:
        return _pinned(pinned)
    path = _cache_path()
    cost = _read(path)
    if cost is None:
        cost = measure()
        _write(path, cost)
    return cost


def host_cost() -> HostCost:
    """This host's cost per op: pinned by ADVISOR_HOST_COST, else cached, else measured now and cached."""
    return _resolved(os.environ.get(ENV) or None)


host_cost.cache_clear = _resolved.cache_clear  # type: ignore[attr-defined]
