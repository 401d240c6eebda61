"""The result of measuring one candidate, whichever backend measured it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    OK = "ok"
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"
    PRUNED = "pruned"


class Source(str, Enum):
    """How a number was obtained, so a prediction is never mistaken for a measurement."""

    ESTIMATE = "estimate"
    SIMULATE = "simulate"
    PROBE_CUDA = "probe-cuda"
    PROBE_CPU = "probe-cpu"
    EXTERNAL = "external"  # a backend registered at runtime (advisor.backends.register_backend) that named none

    @property
    def is_run(self) -> bool:
        """True when the numbers come from really running the training step (not a prediction of it)."""
        return self in (Source.PROBE_CUDA, Source.PROBE_CPU, Source.EXTERNAL)


class Category(str, Enum):
    """What the bytes at the peak are for."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer_state"
    ACTIVATIONS = "activations"
    LM_HEAD = "lm_head_and_loss"
    TEMPORARIES = "temporaries"
    OTHER = "other"
    # reserved outside PyTorch's caching allocator during the step (colocated vLLM's share of the card, advisor/
    # physics/online_costs.py): never in peak / reserved bytes, always in device bytes
    OUTSIDE_ALLOCATOR = "outside_allocator"


@dataclass(frozen=True)
class RankResult:
    """One rank of a multi-process probe: its outcome and its own peaks, step time and trained tokens."""

    rank: int
    status: Status
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    device_bytes: int | None = None
    step_time_s: float | None = None
    trained_tokens_per_step: int | None = None
    message: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))


@dataclass(frozen=True)
class Measurement:
    """Peak memory and speed of one candidate.

    `peak_bytes` follows `torch.cuda.max_memory_allocated`, `reserved_bytes` `max_memory_reserved`,
    `device_bytes` what NVML shows (the budget applies to it). On the CPU all three are the allocator's peak.
    `breakdown` maps a Category value to the bytes live at the peak, where known.
    `step_time_s` is the expected time of one optimizer step over the batches the sampler makes (the peak is the
    worst batch's); `time_breakdown` splits it by term (matmul, attention, memory_bound, lm_head, dequantization,
    optimizer, offload_copies, launch_host) where a model predicted it, and `mfu` is the model FLOPs utilisation.
    """

    status: Status
    source: Source
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    device_bytes: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)
    step_time_s: float | None = None
    tokens_per_second: float | None = None
    trained_tokens_per_step: int | None = None
    peak_batch: str | None = None
    # predicted seconds per optimizer step by term (advisor/physics/timing Term values; they sum to step_time_s)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    mfu: float | None = None  # model FLOPs utilisation against the target's dense peak (predicted or measured)
    worst_step_time_s: float | None = None  # one optimizer step on the worst batch at every micro-step
    message: str = ""
    notes: tuple[str, ...] = ()
    wall_time_s: float | None = None
    # a run on several ranks (a multi-process probe): each rank's own result; the fields above are the run's (the
    # peaks the highest rank's, the throughput over all ranks)
    ranks: tuple[RankResult, ...] = ()
    # reserved outside PyTorch's allocator by a phase of the step (Category.OUTSIDE_ALLOCATOR): part of
    # device_bytes when that is known, added to reserved / peak bytes by `budget_bytes` when it is not
    outside_allocator_bytes: int = 0
    # a predicted step as two queues (advisor/physics/timing): per optimizer step the seconds the device waits on
    # the host ("host_bound_s") and the rest ("device_bound_s"), the ops it dispatches ("ops", "launches", "views",
    # "syncs"), and where the host's cost and the constants come from ("host", "calibration"). A probe: how its step
    # time was taken ("timed_steps", "spread"). Empty where neither applies
    time_detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "ranks", tuple(r if isinstance(r, RankResult) else RankResult(**r)
                                                for r in self.ranks))
        object.__setattr__(self, "source", Source(self.source))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "time_breakdown", {str(k): float(v) for k, v in dict(self.time_breakdown).items()})

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def budget_bytes(self) -> int | None:
        """The bytes a memory budget applies to: the device's (what NVML shows, with what is reserved outside the
        allocator), else the allocator's reserved, else its allocated peak, plus what is reserved outside the
        allocator; None when the backend reported none of them."""
        if self.device_bytes is not None:
            return int(self.device_bytes)
        for v in (self.reserved_bytes, self.peak_bytes):
            if v is not None:
                return int(v) + self.outside_allocator_bytes
        return None

    def fits(self, limit_bytes: int) -> bool:
        """True when the run succeeded and its budget bytes are within `limit_bytes`."""
        used = self.budget_bytes
        return self.ok and used is not None and used <= limit_bytes

    def feasible(self, limit_bytes: int) -> bool:
        """A candidate the search may pick: it fits and trains at a known, positive speed."""
        return self.fits(limit_bytes) and (self.tokens_per_second or 0) > 0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["source"] = self.source.value
        data["notes"] = list(self.notes)
        if self.ranks:
            data["ranks"] = [{**r, "status": Status(r["status"]).value} for r in data["ranks"]]
        else:  # one process: no ranks
            del data["ranks"]
        if not self.outside_allocator_bytes:  # nothing reserved outside the allocator: no key
            del data["outside_allocator_bytes"]
        if not self.time_detail:
            del data["time_detail"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
