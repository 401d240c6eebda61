"""The child side of a real probe: `python -m advisor.probing.worker JOBDIR`.

Reads JOBDIR/job.json (written by runner.job_dict), trains `warmup + steps` optimizer steps with the real
SFTTrainer on the planned rows, and writes JOBDIR/result.json (a Measurement's fields, plus per-step records).
It touches JOBDIR/heartbeat at each stage and each step: the parent's timeout counts from the last touch.
An exception of any kind becomes a result; only a signal or a hang leaves no result, and the parent handles those.

Several ranks: launched N times (`accelerate launch` on CUDA, `torch.distributed.run` with gloo on the
CPU; advisor/probing/ranks.py), each rank reads RANK / WORLD_SIZE / LOCAL_RANK, writes JOBDIR/pid.RANK first and
JOBDIR/result.RANK.json last, dies with its launcher (PR_SET_PDEATHSIG), and exits non-zero after a failure so the
launcher tears the others down. CUDA: accelerate's own FSDP2 / DDP from the config file. CPU: accelerate's FSDP
path refuses a CPU process group, so FSDP2 is applied by accelerate's own `fsdp2_prepare_model` on gloo (as the
simulation applies it, advisor/simulator/distributed.py) and each rank trains on the micro-batches accelerate's
BatchSamplerShard would give it; DDP is accelerate's MULTI_CPU path as it is.

Test hook: the environment variable ADVISOR_PROBE_FAULT (see runner.FAULT_ENV) makes the child kill itself,
hang or raise, deterministically; `@R` limits it to rank R, and `oom` raises torch.OutOfMemoryError.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._files import write_atomic
from ..errors import UsageError
from ..measurement import Category
from ..modeling import placeholder_tokenizer, save_random_input_model, save_random_model
from ..parallelism import Layout
from ..simulator import shard_fsdp2
from ..space import Candidate
from ..workload import Goals, GPUSpec, ModelSpec, Workload
from . import meters
from .meters import StepMeter, is_oom, oom_request_bytes, steady, step_callback
from .runner import FAULT_ENV, HEARTBEAT_FILE, JOB_FILE, RESULT_FILE

# what torchrun / accelerate launch tell each rank
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "GROUP_WORLD_SIZE")


_WHO: tuple[int, int, int] | None = None


def rank_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process as launched ((0, 1, 0) when not launched as a rank); read once,
    since the CPU FSDP2 path hides the launcher's variables from accelerate."""
    global _WHO
    if _WHO is None:
        env = os.environ
        _WHO = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    return _WHO


def _gloo_mesh(world: int):
    """The gloo process group of the launcher's ranks (env://) and its 1-D mesh; then the launcher's variables are
    hidden, so the trainer's accelerator is single-process (accelerate's MULTI_CPU path would wrap DDP)."""
    import torch.distributed as dist  # lazy: loads torch
    from torch.distributed.device_mesh import init_device_mesh  # lazy: loads torch

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for name in _DIST_ENV:
        os.environ.pop(name, None)
    _free_gloo_work_on_this_thread()
    return mesh


def _free_gloo_work_on_this_thread(hold_s: float = 0.02) -> None:
    """FSDP2's reduce-scatter (synchronous) keeps its gloo Work a moment after it completes, so the Work, and what
    only it holds (gloo's clone of the input), is freed on this thread, where the profiler sees the free, rather than
    on gloo's worker thread, which drops its own reference just after completing it (meters.memory_profiler)."""
    import torch.distributed as dist  # lazy: loads torch

    single = dist.reduce_scatter_single

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op:
            return single(output, input, op=op, group=group, async_op=True)
        work = single(output, input, op=op, group=group, async_op=True)
        if work is not None:
            work.wait()
            time.sleep(hold_s)  # gloo's thread resets its reference right after marking the work complete
        del work

    dist.reduce_scatter_single = reduce_scatter_single


def _random_model(spec, jobdir: Path, candidate, rank: int, heartbeat: Heartbeat) -> str:
    """Rank 0 saves the random model once; the other ranks wait for it (rank 0's heartbeat keeps the timeout)."""
    return _saved_once(jobdir / "model", rank, lambda path: save_random_model(spec, path, candidate))


def _random_input_models(workload, kind, jobdir: Path, rank: int) -> dict[str, tuple[str, Any]]:
    """The models given beside the policy (the trainer's ModelInputs): one of each architecture with random weights,
    saved once, which the trainer loads by path as `trl <command>` loads its YAML key (resident beside the policy),
    with its placeholder tokenizer."""
    out = {}
    for inp in kind.model_inputs:
        spec = workload.model_of(inp.role)
        if spec is not None:
            path = _saved_once(jobdir / inp.role, rank, lambda p, s=spec, h=inp.head: save_random_input_model(s, h, p))
            out[inp.role] = (path, placeholder_tokenizer(spec))
    return out


def _saved_once(path: Path, rank: int, save: Callable[[Path], Any]) -> str:
    ready = path.with_name(path.name + ".ready")
    if rank == 0:
        save(path)
        ready.touch()
    else:
        while not ready.exists():
            time.sleep(0.05)
    return str(path)


def result_name(rank: int, world: int) -> str:
    return RESULT_FILE if world <= 1 else f"result.{rank}.json"


def _die_with_parent() -> None:
    """A rank is killed when its launcher dies (Linux PR_SET_PDEATHSIG), whoever kills the launcher."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the runner's sweep of the job's processes remains
        return
    if os.getppid() != parent:  # the launcher died before the prctl
        os._exit(1)


class Heartbeat:
    def __init__(self, path: Path):
        self.path = path

    def beat(self) -> None:
        with open(self.path, "a"):
            pass
        now = time.time()
        os.utime(self.path, (now, now))


def _fault(fault: str, where: str) -> None:
    """Act on ADVISOR_PROBE_FAULT when it names this point (`start` or the first training `step`) and, with `@R`,
    this rank."""
    fault, _, only = fault.partition("@")
    if only and int(only) != rank_info()[0]:
        return
    action, _, at = fault.partition(":")
    if (at or "step") != where:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        while True:  # no heartbeat: the parent's timeout fires
            time.sleep(3600)
    elif action == "raise":
        raise RuntimeError(f"{FAULT_ENV}={fault}: injected failure in the probe's child")
    elif action == "oom":  # what the CUDA caching allocator raises, on this rank only
        import torch  # lazy: loads torch

        raise torch.OutOfMemoryError(f"{FAULT_ENV}={fault}: injected out of memory. Tried to allocate 20.00 MiB")


def _rebuild(job: dict[str, Any]):
    from ..trainers import DEFAULT, get_trainer  # lazy: loads yaml

    def model_spec(m: dict[str, Any]) -> ModelSpec:
        return ModelSpec(name=m["name"], config=m["config"], source=m["source"],
                         local_dir=Path(m["local_dir"]) if m.get("local_dir") else None)

    spec = model_spec(job["model"])
    models = {role: model_spec(m) for role, m in (job.get("models") or {}).items()}
    gpu_fields = dict(job["gpu"])
    gpu_fields["aliases"] = tuple(gpu_fields.get("aliases") or ())
    d = job["dataset"]
    trainer = get_trainer(job.get("trainer") or DEFAULT)
    dataset = trainer.dataset_from_rows(d["name"], d["source"], tuple(d["rows"]), dataset_name=d.get("dataset_name"),
                                        completion_only_loss=d.get("completion_only_loss"))
    workload = Workload(model=spec, gpu=GPUSpec(**gpu_fields), dataset=dataset, goals=Goals(**job["goals"]),
                        trainer=trainer.name, models=models)
    return workload, Candidate.from_dict(job["candidate"])


def _trainer_class(meter: StepMeter, kind=None, shard: tuple[int, int] | None = None):
    """The trainer's TRL class (`kind`: an advisor.trainers.Trainer, SFT when not given) that shows the meter each
    micro-batch (shape and trained tokens) before training on it. `shard` (rank, world): the trainer's accelerator
    is single-process, so its sampler yields this rank's micro-batches as accelerate's BatchSamplerShard deals
    them (micro-batch k of the sequential order to rank k mod N)."""
    from ..trainers import DEFAULT, get_trainer  # lazy: loads yaml

    kind = get_trainer(kind or DEFAULT)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(inputs, dict):
            meter.micro_batch({**inputs, "labels": kind.labels(inputs)})
        return super(cls, self).training_step(model, inputs, num_items_in_batch)

    def _prepare_inputs(self, inputs):
        # online RL (GRPO, RLOO): the dataloader yields prompts and the trainer's own _prepare_inputs generates and
        # scores the micro-batch it trains on; the meter sees that one
        prepared = super(cls, self)._prepare_inputs(inputs)
        if not isinstance(inputs, dict) and isinstance(prepared, dict):
            meter.micro_batch({**prepared, "labels": kind.labels(prepared)})
        return prepared

    def _get_train_sampler(self, train_dataset=None):
        from accelerate.data_loader import BatchSamplerShard  # lazy: loads accelerate
        from torch.utils.data import BatchSampler  # lazy: loads torch

        order = super(cls, self)._get_train_sampler(train_dataset)
        batches = BatchSampler(order, self.args.per_device_train_batch_size, self.args.dataloader_drop_last)
        dealt = BatchSamplerShard(batches, num_processes=shard[1], process_index=shard[0], split_batches=False,
                                  even_batches=True)
        return [i for batch in dealt for i in batch]

    base = kind.trainer_class()
    methods = {**kind.real_overrides(), "training_step": training_step, "_prepare_inputs": _prepare_inputs}
    if shard is not None:
        methods["_get_train_sampler"] = _get_train_sampler
    cls = type(f"Probe{base.__name__}", (base,), methods)
    return cls


def _tensor_bytes(tensors) -> int:
    """Bytes this process holds of `tensors` (a DTensor's local shard)."""
    import torch  # lazy: loads torch

    local = (getattr(t, "_local_tensor", t) for t in tensors if isinstance(t, torch.Tensor))
    return sum(t.numel() * t.element_size() for t in local)


def _breakdown(trainer, peak: int) -> dict[str, int]:
    """Parameters and optimizer state (exact, live at every step's peak after the first); the rest unattributed."""
    params = _tensor_bytes(trainer.model.parameters())
    optim = 0
    if trainer.optimizer is not None:
        optim = _tensor_bytes(v for state in trainer.optimizer.state.values() for v in state.values())
    out = {Category.PARAMETERS.value: params, Category.OPTIMIZER.value: optim}
    rest = peak - params - optim
    if rest > 0:
        out[Category.OTHER.value] = rest
    return out


def _describe(index: int, kinds: list[str], warmup: int, record: dict[str, Any], packed: bool) -> str:
    shapes = record.get("shapes") or []
    kind = "packed" if packed else kinds[index] if index < len(kinds) else "typical"
    warm = ", warm-up" if index < warmup else ""
    if shapes:
        widest = max(shapes, key=lambda s: s[0] * (s[1] if len(s) > 1 else 1))
        batch = f"{len(shapes)} micro-batch(es) up to {' x '.join(map(str, widest))} tokens"
    else:
        batch = "no batch seen"
    return (f"step {index + 1} of {len(kinds)} ({kind} rows{warm}): {batch}, "
            f"{record.get('trained_tokens', 0)} trained tokens")


def run_job(job: dict[str, Any], jobdir: Path, heartbeat: Heartbeat, fault: str, state: dict[str, Any]) -> dict:
    import torch  # lazy: loads torch

    from ..emit import quantization_config  # lazy: loads yaml
    from ..trainers import get_trainer  # lazy: loads yaml

    heartbeat.beat()
    backend = job["backend"]
    cuda = backend == "cuda"
    steps, warmup, budget = int(job["steps"]), int(job["warmup"]), job.get("memory_budget_bytes")
    timing = job.get("timing")
    rank, world, local = rank_info()
    layout = job.get("parallelism", "ddp")
    cpu_fsdp2 = world > 1 and not cuda and layout != "ddp"
    mesh = _gloo_mesh(world) if cpu_fsdp2 else None
    workload, candidate = _rebuild(job)
    kind = get_trainer(workload.trainer)
    spec = workload.model
    notes: list[str] = []
    sampler = ctx = None
    if cuda:
        if not torch.cuda.is_available():
            raise UsageError("--backend cuda: no CUDA device is visible to the probe; use --backend cpu")
        try:
            sampler = meters.NvmlSampler(local_index=local)
        except Exception as exc:  # NVML missing or not permitted: fall back on torch's own figures
            notes.append(f"NVML unavailable ({exc}); device_bytes = reserved + CUDA context estimate")
        ctx = meters.init_cuda(sampler, local)
        if budget:
            fraction = meters.cap_cuda(int(budget), ctx)
            notes.append(f"memory cap: {budget} bytes (allocator fraction {fraction:.4f} + context)")
        if sampler is not None:
            sampler.start()
    model_path = job.get("weights") or _random_model(spec, jobdir, candidate, rank, heartbeat)
    heartbeat.beat()
    tokenizer = placeholder_tokenizer(spec)
    train_dataset = kind.train_dataset(workload)
    total = warmup + steps
    # measured=True: the base's simulated keys (loss, clipping, LoRA dropout, ...) reach the run, its hub and
    # reporting options do not; the probe's own steps replace max_steps
    config = kind.build_config(
        candidate, workload, measured=True, output_dir=str(jobdir / "out"), use_cpu=not cuda, max_steps=total,
        report_to="none", save_strategy="no", logging_strategy="steps", logging_steps=total,
        train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    # the models beside the policy, saved now; the trainer loads them under the meter, as the policy: counted
    models = _random_input_models(workload, kind, jobdir, rank)
    own = kind.trainer_kwargs(workload, candidate, models)  # its own (online RL: the rewards)
    notes.extend(f"{inp.flag} {workload.model_of(inp.role).name}: one of its architecture with random weights, "
                 f"loaded by the trainer from a path as trl {kind.command} loads {inp.yaml_key}"
                 for inp in kind.model_inputs if inp.role in models)
    meter = StepMeter(cuda, heartbeat.beat, lambda: _fault(fault, "step"))
    prof = None
    if not cuda:
        prof = meters.memory_profiler(user_scopes=world <= 1)  # several ranks: gloo's collectives unrecorded
    trainer = _trainer_class(meter, kind, shard=(rank, world) if cpu_fsdp2 else None)(
        model=model_path, args=config, train_dataset=train_dataset, processing_class=tokenizer,
        peft_config=kind.peft_config(candidate, spec), quantization_config=quantization_config(candidate),
        callbacks=[step_callback(meter)], **own,
    )
    if cpu_fsdp2:  # accelerate's own fsdp2_prepare_model on the gloo mesh, before train() builds the optimizer

        shard_fsdp2(trainer.model, mesh, Layout(layout).parallelism, candidate.precision.value)
        notes.append(f"FSDP2 on {world} CPU ranks (gloo): accelerate's fsdp2_prepare_model applied to the loaded "
                     "model before train() (accelerate's FSDP path refuses a CPU process group); each rank's "
                     "micro-batches as accelerate's BatchSamplerShard deals them; each reduce-scatter's gloo Work "
                     "held 20 ms after it completes (so its buffers' frees are seen: meters.memory_profiler), which "
                     "the step times include")
    state["meter"] = meter
    if not cuda and budget:
        # Capped once everything is imported and the model loaded, so code and library mappings don't count;
        # the weights already loaded do.
        torch.ones(64, 64) @ torch.ones(64, 64)  # start the thread pool (its stacks are address space too)
        live = _tensor_bytes(trainer.model.parameters()) + _tensor_bytes(trainer.model.buffers())
        if live >= budget:
            raise MemoryError(f"the loaded model alone takes {live} bytes, more than the budget")
        cap = meters.cap_address_space(int(budget) - live)
        state["cap"] = (f"address space capped at {cap} bytes: current + --memory-budget {budget} less the "
                        f"{live} bytes of weights already loaded")
    trainer.train()
    heartbeat.beat()

    records = list(meter.steps)
    if not records:  # e.g. TRL dropped every planned row (fully masked once truncated)
        raise RuntimeError(f"no training step ran on rank {rank}: the trainer saw no batch of the planned rows")
    packed = bool(candidate.packing)
    kinds = list(job["kinds"])
    if cuda:
        step_peaks = [r["peak_bytes"] for r in records]
        peak = max([meter.setup_peak[0], *step_peaks])
        reserved = max([meter.setup_peak[1], *[r["reserved_bytes"] for r in records]])
        device = reserved + (ctx.context_bytes if ctx else 0)
        if sampler is not None:
            device = max(device, sampler.stop())
        peak_index = max(range(len(records)), key=lambda i: step_peaks[i]) if records else None
        if peak_index is not None and meter.setup_peak[0] > step_peaks[peak_index]:
            peak_index = None
    else:
        prof.__exit__(None, None, None)
        # several ranks: from train() on (each rank loads the whole model before FSDP2 shards it, which a GPU run's
        # cpu_ram_efficient_loading does on the meta device); the loading's own peak is noted
        found = meters.cpu_peak(prof, since_ns=meter.train_begin_ns if world > 1 else None, backend_frees=world > 1)
        peak = reserved = device = found.peak_bytes
        peak_index = None
        if found.time_ns > meter.train_begin_ns:
            peak_index = next((i for i, end in enumerate(meter.ends_ns) if found.time_ns <= end), len(records) - 1)
        notes.append("cpu backend: peak from the CPU allocator's events (torch.profiler); step times include the "
                     "profiler's overhead")
        if world > 1:
            notes.append(f"rank {rank}: peak from train() on (before it each rank loads the whole model, then "
                         "shards it)")
    # the peaks are measured (the CPU's profiler stopped): the steady state is timed on its own run
    timed = _time_steady_state(trainer, meter, timing, int(job["rows_per_step"])) if timing else []
    measured = records[warmup:]
    time_s = sum(r["time_s"] for r in measured)
    tokens = sum(r["trained_tokens"] for r in measured)
    detail: dict[str, Any] = {}
    step_time = time_s / len(measured) if measured else None
    tps = tokens / time_s if time_s > 0 else None
    per_step = int(tokens / len(measured)) if measured else None
    if timing and timed:
        w = int(timing["window"])
        last = timed[-w:]
        step_time = statistics.median(last)
        per_step = int(statistics.median(r["trained_tokens"] for r in meter.steps[total + 1:][-w:]))
        tps = per_step / step_time if step_time > 0 else None
        cpu = [r["cpu_s"] for r in meter.steps[total + 1:]]
        detail = {"timed_steps": len(timed), "spread": max(last) / min(last) - 1.0,
                  "stable": len(timed) >= 2 * w and steady(timed, w, float(timing["tolerance"])),
                  "timed_batch": "longest", "steady_step_s": timed,
                  # the CPU time of the same steps (all threads of the process): on the cpu backend with one thread,
                  # the step's own work, without what other processes of a shared machine take from it
                  "steady_cpu_s": cpu, "cpu_step_s": statistics.median(cpu[-w:]) if cpu else None}
        notes.append(f"step time: the median of the last {len(last)} of {len(timed)} steady-state steps of the "
                     f"longest rows (each shape run once untimed first), spread {detail['spread']:.1%}"
                     + ("" if detail["stable"] else f"; not stable within {float(timing['tolerance']):.0%} when "
                                                   "the bound was reached"))
    peak_batch = (_describe(peak_index, kinds, warmup, records[peak_index], packed) if peak_index is not None
                  else "setup (model loading, before the first step)")
    if "cap" in state:
        notes.append(state["cap"])
    return {
        "status": "ok",
        "rank": rank,
        "world": world,
        "peak_bytes": int(peak),
        "reserved_bytes": int(reserved),
        "device_bytes": int(device),
        "breakdown": _breakdown(trainer, int(peak)),
        "step_time_s": step_time,
        "tokens_per_second": tps,
        "trained_tokens_per_step": per_step,
        "time_detail": detail,
        "peak_batch": peak_batch,
        "notes": notes,
        "steps": [{**r, "description": _describe(i, kinds, warmup, r, packed)} for i, r in enumerate(records)],
    }


def _time_steady_state(trainer: Any, meter: StepMeter, timing: dict[str, Any], rows_per_step: int) -> list[float]:
    """Once memory is measured (and the CPU's profiler stopped): `train()` again, without the profiler, on the first
    step's rows over and over (the longest rows, runner.plan_batches; packed: the first packed rows), until the
    steady state (StepMeter.done). Returns the timed steps' seconds."""
    ds = trainer.train_dataset
    steps = 1 + int(timing["max_steps"])
    per_step = min(len(ds), max(1, trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
                                if getattr(trainer.args, "packing", False) else rows_per_step))
    trainer.train_dataset = ds.select(list(range(per_step)) * steps)
    trainer.args.max_steps = steps
    meter.time_steady_state(timing)
    trainer.train()
    return meter.timed()


def failure(exc: BaseException, job: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """An exception in the child as a result: an allocation failure is `oom` (with its size), the rest `error`."""
    meter = state.get("meter")
    where = f" in step {len(meter.steps) + 1}" if meter is not None and meter.train_begin_ns else " before training"
    if is_oom(exc):
        size = oom_request_bytes(str(exc))
        text = str(exc).strip().splitlines()
        what = (f"allocating {size} bytes ({size / 2**20:.1f} MiB)" if size is not None
                else f"allocating memory ({text[0]})" if text else "allocating memory")
        budget = job.get("memory_budget_bytes")
        cap = f" under --memory-budget {budget} bytes" if budget else ""
        notes = [state["cap"]] if "cap" in state else []
        return {"status": "oom", "message": f"out of memory{where} while {what}{cap}", "notes": notes}
    tb = traceback.extract_tb(exc.__traceback__)
    origin = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    text = str(exc).strip().splitlines()
    return {"status": "error", "message": f"{type(exc).__name__}{where}: {text[0] if text else ''}{origin}",
            "notes": text[1:6]}


def write_result(jobdir: Path, result: dict[str, Any]) -> None:
    rank, world, _ = rank_info()
    write_atomic(jobdir / result_name(rank, world), json.dumps(result, default=str))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    jobdir = Path(argv[0])
    rank, world, _ = rank_info()
    if world > 1:
        _die_with_parent()
        (jobdir / f"pid.{rank}").write_text(str(os.getpid()))  # the runner kills what it lists, whatever happens
    heartbeat = Heartbeat(jobdir / HEARTBEAT_FILE)
    heartbeat.beat()
    fault = os.environ.get(FAULT_ENV, "")
    _fault(fault, "start")
    job = json.loads((jobdir / JOB_FILE).read_text())
    state: dict[str, Any] = {}
    try:
        result = run_job(job, jobdir, heartbeat, fault, state)
    except BaseException as exc:  # every failure is data for the parent
        traceback.print_exc()
        result = failure(exc, job, state)
    result["rank"] = rank
    write_result(jobdir, result)
    sys.stdout.flush()
    sys.stderr.flush()
    ok = result.get("status") == "ok"
    if world > 1 and ok:
        import torch.distributed as dist  # lazy: loads torch

        if dist.is_initialized():  # no rank leaves while another still needs it in a collective
            dist.barrier()
    # skip interpreter teardown: threads, CUDA and the profiler die with the process; a failed rank exits non-zero,
    # so the launcher stops the others at once
    os._exit(0 if ok or world <= 1 else 1)


if __name__ == "__main__":
    main()
