"""What runs in the pool's forkserver and its workers (advisor/search/pool.py is the caller's side): the
forkserver's warm-up, imported with its preload, and a worker's loop (a log file for every output, the workloads
it keeps, each candidate measured with what its libraries said collected, a crash left to the caller to see)."""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import pickle
import signal
import sys
from typing import Any

_WARM_ENV = "ADVISOR_POOL_WARM_FORKSERVER"
# Set empty in the forkserver's environment (so in every worker's): the workers simulate on fake tensors and never
# use a GPU, and autograd's engine must count no device when it first runs there (`_autograd_without_threads`).
HIDE_GPUS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
_WORKLOADS_KEPT = 4  # workloads a worker keeps (by fingerprint); a search uses one


def _resolve(ref: str) -> Any:
    module, qualname = ref.split(":", 1)
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _autograd_without_threads() -> None:
    """In the forkserver, before anything else runs autograd: one backward on a real CPU tensor, while no device
    is visible (HIDE_GPUS), so that autograd's engine initialises its device threads, once per process, with none.

    The engine starts a thread per device of every non-CPU device type it counts at its first backward, and from
    then on a forked child's backward raises "Unable to handle autograd's threading in combination with
    fork-based multiprocessing". With a CUDA build of torch it counts CUDA's devices: the GPUs on a GPU machine,
    and on a machine without one, the one device of the no-op CUDA guard that FakeTensorMode installs when it is
    first entered (`torch._C._ensureCUDADeviceGuardSet`). Either way every simulation in the workers failed. The
    engine counts only once: initialised here with no device, it starts no thread in the server or its forks,
    whatever a simulation installs later (the CPU build's engine never counts a device, so nothing changes there)."""
    import torch  # lazy: torch loads in the forkserver, GPUs hidden first

    x = torch.zeros((), requires_grad=True)
    x.backward()


def _warm_up() -> None:
    """In the forkserver: simulate a tiny model's full and LoRA candidate on a CUDA target once, single-threaded
    (no OpenMP pool exists before the fork), so that every worker forks with the simulator's lazy imports and
    first-call initialisation done. Best effort: a failure only costs the workers that time."""
    os.environ.pop(_WARM_ENV, None)
    import torch  # lazy: torch loads in the forkserver, GPUs hidden first

    _autograd_without_threads()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from .._messages import capture  # lazy: the forkserver's warm-up only
        from ..data import synthetic  # lazy: the forkserver's warm-up only
        from ..profiles import resolve_gpu  # lazy: the forkserver's warm-up only
        from ..simulator import simulate  # lazy: the forkserver's warm-up only
        from ..space import Candidate  # lazy: the forkserver's warm-up only
        from ..workload import Goals, ModelSpec, Workload  # lazy: the forkserver's warm-up only

        config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
                  "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1,
                  "eos_token_id": 2, "pad_token_id": 0}
        wl = Workload(model=ModelSpec(name="pool-warm-up", config=config, source="local"),
                      gpu=resolve_gpu("H100-80GB"), dataset=synthetic(vocab_size=1024, rows=16, max_len=128),
                      goals=Goals())
        with capture():
            for cand in (Candidate(max_length=128, per_device_train_batch_size=2),
                         Candidate(max_length=128, per_device_train_batch_size=2, use_lora=True)):
                simulate(wl, cand)
    except Exception as exc:
        print(f"advisor pool: the forkserver's warm-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)


def _worker_main(conn: Any, log: str, ref: str, threads: int) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)  # never the terminal: C-level output too
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the caller's; close() stops the workers
    _die_with_parent()
    import faulthandler  # lazy: the worker's start-up, in its order

    faulthandler.enable(file=sys.stderr)  # a segfault's traceback lands in the log, whose tail names the crash
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # lazy: the worker's start-up, in its order

    from .._messages import capture  # lazy: the worker's start-up, in its order

    torch.set_num_threads(threads)
    fn = _resolve(ref)
    workloads: collections.OrderedDict[str, Any] = collections.OrderedDict()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the pool went away
            return
        if msg[0] == "stop":
            return
        if msg[0] == "workload":
            _, fp, blob = msg
            workloads[fp] = pickle.loads(blob)
            while len(workloads) > _WORKLOADS_KEPT:
                workloads.popitem(last=False)
            continue
        _, task_id, fp, candidate = msg
        retire = False
        with capture() as said:
            try:
                reply = ("result", fn(workloads[fp], candidate))
            except MemoryError as exc:  # the host ran out: answer, then leave for a fresh worker
                reply, retire = ("memory", f"MemoryError: {exc}"), True
            except Exception as exc:
                reply = ("exception", _portable(exc))
            except BaseException as exc:  # SystemExit and kin must not end the caller: a RemoteError there
                reply = ("exception", (type(exc).__name__, str(exc)))
        conn.send(("done", task_id, reply, dict(said)))
        if retire:
            return


def _portable(exc: BaseException) -> Any:
    """The exception itself when it survives a pickle round trip, else its type name and text."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return (type(exc).__name__, str(exc))


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that forked it (the forkserver) dies."""
    with contextlib.suppress(Exception):
        import ctypes  # lazy: the worker only

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG



if os.environ.get(_WARM_ENV) == "1":  # imported by the forkserver's preload
    _warm_up()
