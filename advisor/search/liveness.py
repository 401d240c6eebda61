"""Which trials are alive: owners, heartbeats, stale trials, claims. The one module that touches Optuna's insides
(a study's storage, a trial's id, its fixed params, telling a trial that another process failed).

A measuring trial stamps the wall clock into its "heartbeat" user attr every HEARTBEAT_S; a RUNNING trial whose
stamp is older than STALE_S belongs to a killed process: it is failed and its candidate can be measured again.
A trial also names its "owner" (host, pid, process start): on the same host a dead owner is seen at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

HEARTBEAT_S = 10.0
STALE_S = 120.0
CLAIM_POLL_S = 0.05


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so that a reused pid is not taken for it;
    "zombie" for a process that has exited but is not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "zombie" if fields[0] in ("Z", "X") else fields[19]


_OWNERS: dict[int, list[Any]] = {}


def owner() -> list[Any]:
    """[host, pid, start] of this process (per pid: a forked worker is its own owner)."""
    pid = os.getpid()
    if pid not in _OWNERS:
        _OWNERS[pid] = [socket.gethostname(), pid, process_start(pid)]
    return _OWNERS[pid]


def owner_dead(who: Any) -> bool:
    """True when `who` ([host, pid, start]) was a process on this host that no longer runs."""
    me = owner()
    if not isinstance(who, list) or len(who) != 3 or who[0] != me[0] or who[1] == me[1]:
        return False  # another machine (its heartbeat decides), an older advisor, or this very process
    try:
        pid = int(who[1])
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError, TypeError):
        return False
    now = process_start(pid)
    return now == "zombie" or (who[2] is not None and now is not None and now != who[2])


def storage_of(study: optuna.Study) -> optuna.storages.BaseStorage:
    return study._storage


def fixed_params(t: FrozenTrial) -> dict[str, Any]:
    """The params a queued (or popped) trial was enqueued with, else those it has suggested."""
    return t.system_attrs.get("fixed_params") or t.params


def live_running(study: optuna.Study, on_stale: Callable[[FrozenTrial], None]) -> list[FrozenTrial]:
    """RUNNING trials whose owner is alive; `on_stale` is called for each stale one (a killed run or worker): a
    dead owner process on this host at once, any other when its heartbeat is older than STALE_S."""
    from optuna.trial import TrialState  # lazy: loads optuna

    now, live = time.time(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        beat = t.user_attrs.get("heartbeat")
        if beat is None and t.datetime_start is not None:
            beat = t.datetime_start.timestamp()
        if owner_dead(t.user_attrs.get("owner")) or (beat is not None and now - float(beat) > STALE_S):
            on_stale(t)
            continue
        live.append(t)
    return live


def fail_stale(study: optuna.Study, t: FrozenTrial) -> bool:
    """Fail a dead process's trial; True when this process's FAIL landed (so it, and only it, queues again)."""
    from optuna.trial import TrialState  # lazy: loads optuna

    try:
        study._storage.set_trial_user_attr(t._trial_id, "stale", True)
        study.tell(t.number, state=TrialState.FAIL)
    except Exception:  # its owner finished it meanwhile, or another process failed it first
        return False
    return True


def fail(study: optuna.Study, trial: optuna.Trial | int) -> None:
    from optuna.trial import TrialState  # lazy: loads optuna

    study.tell(trial, state=TrialState.FAIL)


def claim(trial: optuna.Trial, key: str, measured: Callable[[], bool],
          running: Callable[[], list[FrozenTrial]]) -> bool:
    """True when this trial is the one to evaluate `key`; False when another live trial has it.

    Several processes may pop trials of one candidate at once (two runs enqueue the same seeds). Each trial
    has written its key before it looks: a trial yields to one of the same key that is measuring or has a
    lower number, waits while only higher-numbered ones are still deciding (they never wait on it), and
    otherwise marks itself measuring. So exactly one measures, and none waits in a cycle. `measured()` refreshes
    the caller's ledger and says whether `key` is in it now; `running()` lists the live RUNNING trials.
    """
    number, deadline = trial.number, time.monotonic() + STALE_S
    while True:
        if measured():
            return True  # measured meanwhile: the evaluator answers from the ledger
        others = [t for t in running() if t.user_attrs.get("key") == key and t.number != number]
        if any(t.user_attrs.get("measuring") or t.number < number for t in others):
            return False
        if not others or time.monotonic() > deadline:
            trial.set_user_attr("measuring", True)
            return True
        time.sleep(CLAIM_POLL_S)


@contextlib.contextmanager
def heartbeat(trial: optuna.Trial) -> Iterator[None]:
    """Keep `trial`'s heartbeat fresh while it is measured, so that others can tell it from a dead one."""
    trial.set_user_attr("heartbeat", time.time())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                trial.set_user_attr("heartbeat", time.time())
            except Exception:  # the storage went away: the trial will be judged stale, as it should
                return

    thread = threading.Thread(target=beat, name="advisor-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def finish(study: optuna.Study, trial: optuna.Trial, value: float) -> None:
    """Tell the study; if another process judged this trial stale and failed it meanwhile (its heartbeat
    could not be written for STALE_S), the result is stored as a new finished trial, not lost."""
    import optuna  # lazy: loads optuna

    try:
        study.tell(trial, value)
        return
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
        frozen = study._storage.get_trial(trial._trial_id)
        if frozen.state is not optuna.trial.TrialState.FAIL:
            raise
    attrs = {k: v for k, v in frozen.user_attrs.items() if k not in ("stale", "measuring")}
    study.add_trial(optuna.trial.create_trial(
        params=frozen.params, distributions=frozen.distributions, value=value, user_attrs=attrs,
        system_attrs={k: v for k, v in frozen.system_attrs.items() if k.startswith("constraints")}))


def ask(study: optuna.Study) -> optuna.Trial:
    """`study.ask()`, except that a candidate queued again after its process died ("retry") is popped before the
    other waiting trials (Optuna pops by number, which would put it behind the seeds still waiting, so that a
    resumed run with few trials measured other candidates than a fresh one)."""
    from optuna.exceptions import UpdateFinishedTrialError  # lazy: loads optuna
    from optuna.trial import TrialState  # lazy: loads optuna

    storage = study._storage

    def pop() -> int | None:
        waiting = storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
        for t in sorted(waiting, key=lambda t: (t.user_attrs.get("proposed_by") != "retry", t.number)):
            try:
                if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    return t._trial_id
            except UpdateFinishedTrialError:
                continue
        return None

    study._pop_waiting_trial_id = pop  # type: ignore[method-assign]
    try:
        return study.ask()
    finally:
        del study._pop_waiting_trial_id
