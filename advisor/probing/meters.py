"""Meters of a probe's child process: the CPU allocator's events, torch.cuda's peaks, NVML sampling, and each
optimizer step's time, shapes and peaks (`StepMeter`, driven by the Trainer callback `step_callback`).

Everything here runs inside the child (advisor.probing.worker); the parent never touches a device.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def oom_request_bytes(message: str) -> int | None:
    """How much was being allocated when an allocation failed, parsed from torch's CPU or CUDA message."""
    m = re.search(r"you tried to allocate (\d+) bytes", message)
    if m:
        return int(m.group(1))
    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    return None


def is_oom(exc: BaseException) -> bool:
    """True for an allocation failure: CUDA OOM, the CPU allocator under RLIMIT_AS, Python's MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch  # lazy: loads torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "Cannot allocate memory" in text or "std::bad_alloc" in text
        or "out of memory" in text.lower()
    )


# ---- CPU: the allocator's own events -------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocationPeak:
    """The largest total the CPU allocator reported while profiling, and when (profiler clock, ns)."""

    peak_bytes: int
    time_ns: int
    events: int


def memory_profiler(*, user_scopes: bool = True) -> Any:
    """A started torch.profiler.profile of the CPU with the allocator's events (profile_memory=True); stop it with
    `__exit__(None, None, None)`.

    `user_scopes=False` leaves out record functions of RecordScope.USER_SCOPE (several ranks on gloo). Measured on
    2-rank gloo FSDP2 runs: the profiler's memory events are per thread, and buffers of gloo's collectives
    (all-gather outputs, FSDP's reduce-scatter inputs, gloo's clones of them) are freed on gloo's worker threads when
    the worker drops its Work after the caller did: the profile shows them never freed, a few per step, so the
    replayed peak read high by one FSDP unit or more, growing with the steps (8 steps: 0.6-1.4 MB over the
    simulation); gc.collect() freed none; with the profiler off the host's malloc heap grew 10-40 KB a step, not by
    those units, so a run frees them. Three measures remove them: no USER_SCOPE callbacks (with them gloo records
    each collective, capturing its inputs: the all-gather outputs were among the missed frees), the CPU rank holding
    each reduce-scatter's Work a moment after it completes (worker._free_gloo_work_on_this_thread), and
    `cpu_peak(backend_frees=True)`. Then most rank-runs match the simulation within 200 bytes (3 and 9 steps), but
    now and then a rank, more often under load, still reads one FSDP reduce-scatter input (a unit's bytes) high:
    its last reference also dropped on a gloo thread, by a path not found.
    """
    import torch  # lazy: loads torch
    import torch.autograd.profiler as autograd_profiler  # lazy: loads torch
    from torch._C._profiler import RecordScope  # lazy: loads torch

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    if user_scopes:
        prof.__enter__()
        return prof
    enable = autograd_profiler._enable_profiler
    scopes = {s for s in RecordScope.__members__.values() if s is not RecordScope.USER_SCOPE}
    autograd_profiler._enable_profiler = lambda config, activities: enable(config, activities, scopes)
    try:
        prof.__enter__()
    finally:
        autograd_profiler._enable_profiler = enable
    return prof


def cpu_peak(prof: Any, since_ns: int | None = None, *, backend_frees: bool = False) -> AllocationPeak:
    """Peak of bytes allocated through PyTorch's CPU allocator while `prof` (profile_memory=True) ran.

    Replays every Allocation event (frees are negative) of every thread in time order. Only blocks allocated
    while profiling count, so start the profiler before the model is loaded: what was live before it is
    import-time state, not the training's. `since_ns` (the profiler's clock): the highest total from that moment on
    (what was allocated before it and is still live counts; a higher total before it, such as the full model a rank
    materialises before FSDP2 shards it, does not).

    `backend_frees` (gloo): a block allocated inside a `c10d::` op (the backend's own copy, such as gloo's clone of
    a reduce-scatter's input, which only its Work holds) whose free the profile does not show before its address is
    allocated again, or at all, was freed on one of gloo's worker threads, which the profiler does not follow
    (memory_profiler): it is replayed as freed when that op returned (FSDP2's reduce-scatter is synchronous); any
    other block whose address is allocated again without a free between is replayed as freed just before that.
    """
    from torch._C._profiler import _EventType  # lazy: loads torch

    allocations: list[tuple[int, int, int, int, int | None]] = []
    stack = [(node, None) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, comm_end = stack.pop()
        if node.tag == _EventType.Allocation:
            ef = node.extra_fields
            if str(ef.device).startswith("cpu"):
                allocations.append((node.start_time_ns, int(ef.alloc_size), int(ef.total_allocated), int(ef.ptr),
                                    comm_end))
        elif comm_end is None and backend_frees and node.name.startswith("c10d::"):
            comm_end = node.end_time_ns
        stack.extend((child, comm_end) for child in node.children)
    allocations.sort(key=lambda a: a[0])
    if backend_frees:
        allocations = _with_missed_frees(allocations)
    live = peak = 0
    peak_t = allocations[0][0] if allocations else 0
    # the allocator's running total counts what was live before profiling too: measure it from there
    before = allocations[0][2] - allocations[0][1] if allocations else 0
    for t, size, total, _, _ in allocations:
        live += size
        # the running total misses the same frees as the events: with backend_frees the replay alone counts
        current = live if backend_frees else max(live, total - before)
        if since_ns is not None and t < since_ns:
            peak, peak_t = current, t  # the level carried into the window
            continue
        if current > peak:
            peak, peak_t = current, t
    return AllocationPeak(peak_bytes=peak, time_ns=peak_t, events=len(allocations))


def _with_missed_frees(allocations: list[tuple[int, int, int, int, int | None]]) -> list:
    """`allocations` (time order) plus the frees the profile missed: a block whose address is allocated again was
    freed by then at the latest (the allocator hands out no live address); one allocated inside a collective whose
    free is missing was freed when that op returned."""
    open_blocks: dict[int, tuple[int, int | None]] = {}
    missed = []
    for t, size, _, ptr, comm_end in allocations:
        if size > 0:
            if ptr in open_blocks:  # allocated again: the earlier block was freed unseen, at the latest now
                prev_size, prev_end = open_blocks[ptr]
                missed.append((min(prev_end or t, t) - 1, -prev_size, 0, ptr, None))
            open_blocks[ptr] = (size, comm_end)
        else:
            open_blocks.pop(ptr, None)
    missed += [(end, -size, 0, ptr, None) for ptr, (size, end) in open_blocks.items() if end is not None]
    return sorted(allocations + missed, key=lambda a: a[0])


def address_space_bytes() -> int:
    """The process's current virtual address space (VmSize), which RLIMIT_AS limits."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def cap_address_space(budget_bytes: int) -> int:
    """Let the process map at most `budget_bytes` more than now: a larger allocation really fails. Returns the cap."""
    cap = address_space_bytes() + int(budget_bytes)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


# ---- CUDA ----------------------------------------------------------------------------------------------------
class NvmlSampler:
    """Samples the device memory this process uses through NVML in a daemon thread.

    Uses the per-process figure when NVML lists this pid (it does not inside some containers' pid namespaces);
    otherwise the device's used memory minus what was used before this process created its CUDA context.
    """

    def __init__(self, interval_s: float = 0.005, local_index: int = 0):
        import pynvml  # lazy: loads pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = _nvml_handle(pynvml, local_index)
        self.total_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        self.baseline_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.per_process = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> int:
        """This process's device memory now."""
        pid = os.getpid()
        try:
            for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    self.per_process = True
                    return int(p.usedGpuMemory)
        except self._nvml.NVMLError:
            pass
        return max(0, int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) - self.baseline_bytes)

    def sample(self) -> int:
        value = self.read()
        self.peak_bytes = max(self.peak_bytes, value)
        return value

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> NvmlSampler:
        self._thread = threading.Thread(target=self._loop, name="advisor-nvml", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.sample()
        return self.peak_bytes


def _nvml_handle(pynvml: Any, local_index: int = 0) -> Any:
    """The NVML handle of the device that torch calls cuda:`local_index` (honours CUDA_VISIBLE_DEVICES; a rank of a
    multi-GPU probe uses its LOCAL_RANK)."""
    listed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    visible = listed[local_index] if local_index < len(listed) else ""
    if visible.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(visible)
    if visible.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(visible))
    return pynvml.nvmlDeviceGetHandleByIndex(local_index)


@dataclass(frozen=True)
class CudaContext:
    """What the device holds for this process before any tensor: the CUDA context and the allocator's reserve."""

    context_bytes: int
    total_bytes: int


def init_cuda(sampler: NvmlSampler | None, local_index: int = 0) -> CudaContext:
    """Create the CUDA context on cuda:`local_index` (a rank's LOCAL_RANK, else 0), make it the current device and
    measure the context (NVML reading minus what torch reserved)."""
    import torch  # lazy: loads torch

    torch.cuda.init()
    torch.cuda.set_device(local_index)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(local_index).total_memory
    context = 0
    if sampler is not None:
        context = max(0, sampler.sample() - torch.cuda.memory_reserved())
    return CudaContext(context_bytes=context, total_bytes=int(total))


def cap_cuda(budget_bytes: int, ctx: CudaContext) -> float:
    """Cap the caching allocator so that reserved + context stays within `budget_bytes`; returns the fraction."""
    import torch  # lazy: loads torch

    usable = budget_bytes - ctx.context_bytes
    if usable <= 0:  # the candidate cannot run at all under this cap: that is an OOM, not a usage error
        raise MemoryError(f"the CUDA context alone takes {ctx.context_bytes} bytes, more than the budget")
    fraction = min(1.0, usable / ctx.total_bytes)
    torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device())
    return fraction


class StepMeter:
    """Per optimizer step: end time, micro-batch shapes, trained tokens, and (CUDA) the allocator's peaks. After the
    `memory_steps` (the peaks' steps) `on_memory_done` runs (the CPU's profiler stops) and the steady state is timed
    (`timing`: runner.Timing's fields, set for the timing run; `done()` says when to stop)."""

    def __init__(self, cuda: bool, beat: Callable[[], None], first_step: Callable[[], None]):
        self.cuda = cuda
        self.beat = beat  # the heartbeat the parent's timeout counts from
        self.first_step = first_step  # the test hook's fault at the first step
        self.memory_steps = 0
        self.timing: dict[str, Any] | None = None
        self.timing_started = 0.0
        self._cpu = 0.0
        self.train_begin_ns = 0
        self.setup_peak = (0, 0)
        self.ends_ns: list[int] = []
        self.steps: list[dict[str, Any]] = []
        self._shapes: list[list[int]] = []
        self._trained = 0

    def micro_batch(self, inputs: dict[str, Any]) -> None:
        ids = inputs.get("input_ids", inputs.get("completion_ids"))  # online RL: the generated completions
        labels = inputs.get("labels")
        if ids is not None:
            self._shapes.append(list(ids.shape))
        if labels is not None:
            self._trained += int((labels != -100).sum())

    def train_begin(self) -> None:
        if self.cuda:
            import torch  # lazy: loads torch

            torch.cuda.synchronize()
            self.setup_peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        self.beat()
        self.train_begin_ns = time.time_ns()
        self._cpu = time.process_time()

    def step_begin(self) -> None:
        if not self.steps:
            self.first_step()

    def step_end(self) -> None:
        record: dict[str, Any] = {"shapes": self._shapes, "trained_tokens": self._trained}
        if self.cuda:
            import torch  # lazy: loads torch

            torch.cuda.synchronize()
            record["peak_bytes"] = torch.cuda.max_memory_allocated()
            record["reserved_bytes"] = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        now = time.time_ns()
        previous = self.ends_ns[-1] if self.ends_ns else self.train_begin_ns
        record["time_s"] = (now - previous) / 1e9
        cpu = time.process_time()  # the process's own CPU time: on a shared machine, without what others take
        record["cpu_s"] = cpu - self._cpu
        self._cpu = cpu
        self.ends_ns.append(now)
        self.steps.append(record)
        self._shapes, self._trained = [], 0
        self.beat()

    def time_steady_state(self, timing: dict[str, Any]) -> None:
        """The steps from now on are the timing run's."""
        self.memory_steps, self.timing, self.timing_started = len(self.steps), timing, time.monotonic()

    def timed(self) -> list[float]:
        """The steady-state steps' times: after the memory steps and one untimed step of the timed shape."""
        return [r["time_s"] for r in self.steps[self.memory_steps + 1:]]

    def done(self) -> bool:
        """Whether the steady state is timed: the median of the last `window` steps within `tolerance` of the median
        of the `window` before them, or the bounds reached."""
        t = self.timing
        if not t or len(self.steps) <= self.memory_steps:
            return False
        times = self.timed()
        w = int(t["window"])
        if len(times) >= int(t["max_steps"]) or time.monotonic() - self.timing_started > float(t["max_s"]):
            return True
        return len(times) >= 2 * w and steady(times, w, float(t["tolerance"]))


def steady(times: list[float], window: int, tolerance: float) -> bool:
    """The median of the last `window` times within `tolerance` of the median of the `window` before them."""
    now, before = statistics.median(times[-window:]), statistics.median(times[-2 * window:-window])
    return abs(now - before) <= tolerance * now


def step_callback(meter: StepMeter):
    """The Trainer callback that drives `meter` and stops training once the steady state is timed."""
    from transformers import TrainerCallback  # lazy: loads transformers

    class _Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.train_begin()

        def on_step_begin(self, args, state, control, **kwargs):
            meter.step_begin()

        def on_step_end(self, args, state, control, **kwargs):
            meter.step_end()
            if meter.done():
                control.should_training_stop = True

    return _Callback()
