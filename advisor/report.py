"""What the search chose and why: a table of every trial (tabulate), and a plot of peak against throughput."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError
from .knobs import summary_rows, trial_label

if TYPE_CHECKING:
    from .measurement import Measurement
    from .suggestion import Suggestion, Trial
    from .trainers import Trainer

_GiB = 2**30


def _gib(v: int | None) -> str:
    return "-" if v is None else f"{v / _GiB:.2f}"


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _step(m: Measurement) -> str:
    """The step time with its largest terms and the MFU, in one cell."""
    if not m.step_time_s:
        return "-"
    top = sorted(m.time_breakdown.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{k} {v / m.step_time_s:.0%}" for k, v in top)
    mfu = f"; MFU {m.mfu:.1%}" if m.mfu is not None else ""
    return f"{m.step_time_s:.4f}" + (f" ({parts}{mfu})" if parts or mfu else "")


def _knobs(t: Trial, trainer: Trainer | None) -> str:
    """The candidate cell: each knob's token (advisor/knobs.py `short`), a trainer's own knobs included (DPO's
    ref=precomputed is its knob's token)."""
    return trial_label(t.candidate, trainer)


def _trainer_rows(s: Suggestion) -> list[list[str]]:
    """What the trainer says of the pick (`Trainer.report_rows`: the trainer, its own knobs' rows from their
    declarations, and for DPO how the reference is held)."""
    return s.trainer.report_rows(s.candidate)


def time_lines(m: Measurement) -> list[str]:
    """The step time, its parts by term and the MFU, as `advisor simulate` prints them (empty when not timed)."""
    if not m.step_time_s:
        return []
    kind = "measured" if m.source.value.startswith("probe") else "predicted"
    tps = f"{m.tokens_per_second:,.0f}" if m.tokens_per_second else "-"
    out = [f"step time     {m.step_time_s:.4f} s  ({tps} trained tokens/s, {kind}; expected over the sampler's "
           "batches)"]
    for term, seconds in sorted(m.time_breakdown.items(), key=lambda kv: -kv[1]):
        out.append(f"  {term:<18}{seconds * 1e3:9.2f} ms  {seconds / m.step_time_s:6.1%}")
    if m.mfu is not None:
        out.append(f"MFU           {m.mfu:.1%}  (model FLOPs over the dense peak)")
    out += queue_lines(m.time_detail, m.step_time_s)
    return out


def queue_lines(d: dict, step_s: float) -> list[str]:
    """Host-bound against device-bound time, the ops dispatched, and where the host's cost and the constants come
    from (a prediction), or how a probe timed its steps."""
    out = []
    if "host_bound_s" in d:
        hb, db = float(d["host_bound_s"]), float(d["device_bound_s"])
        out.append(f"queues        host-bound {hb * 1e3:.2f} ms ({hb / step_s:.0%}), device-bound {db * 1e3:.2f} ms "
                   f"({db / step_s:.0%}) a step")
        out.append(f"ops           {d['ops']:,.0f} a step: {d['launches']:,.0f} kernel launches, {d['views']:,.0f} "
                   f"without a kernel, {d['syncs']:,.0f} syncs")
    if d.get("host"):
        out.append(f"host          {d['host']}")
    if d.get("calibration"):
        out.append(f"constants     {d['calibration']}")
    if "timed_steps" in d:
        out.append(f"timed         {d['timed_steps']} steady-state steps (median), spread {d['spread']:.1%} "
                   f"(last 5: max / min - 1){'' if d.get('stable') else ', not stable within 5%'}")
    return out


def trial_rows(s: Suggestion) -> list[list[str]]:
    limit = s.workload.limit_bytes
    rows = []
    for t in sorted(s.trials, key=lambda t: -(t.measurement.tokens_per_second or 0) if t.measurement.feasible(limit)
                    else float("inf")):
        m = t.measurement
        rows.append(["" if t.number is None else str(t.number), _knobs(t, s.trainer),
                     _gib(m.budget_bytes),
                     _tps(m.tokens_per_second), m.status.value,
                     m.source.value + (" (stored)" if t.cached else ""), t.reason])
    return rows


def _evaluations(s: Suggestion) -> str:
    """Distinct candidates this search measured with its backend, and those the stored study answered."""
    stored = sum(1 for t in s.trials if t.cached and t.measurement.status.value != "pruned")
    return f"{s.evaluations}" + (f" (+{stored} answered from the stored study)" if stored else "")


def _measured(s: Suggestion) -> bool:
    """Real steps on the target (a probe), as opposed to the estimate's or the simulator's prediction."""
    return s.measured_on_target


def _kind(s: Suggestion) -> str:
    return "measured" if _measured(s) else "predicted"


def render_summary(s: Suggestion) -> str:
    """The short table the CLI prints by default: what was chosen, its numbers, and why."""
    from tabulate import tabulate  # lazy: loads tabulate

    c, m, wl = s.candidate, s.measurement, s.workload
    rows = [
        ["model", wl.model.name], ["target", f"{wl.gpu.name} (limit {_gib(wl.limit_bytes)} GiB of "
                                            f"{_gib(wl.budget_bytes)} GiB)"],
        ["method", c.method.value],
        *_trainer_rows(s),
        *summary_rows(c, s.trainer),  # each knob's label and value, of the knobs its trainer has (advisor/knobs.py)
        [f"device peak (GiB, {_kind(s)})", _gib(m.budget_bytes)],
        [f"tokens/s (trained, {_kind(s)})", _tps(m.tokens_per_second)],
        [f"step time (s, {_kind(s)})", _step(m)],
        ["source", m.source.value + ("" if _measured(s) else f" (a prediction for {wl.gpu.name}, not a run on it)")],
        ["evaluations", _evaluations(s)],
    ]
    out = tabulate(rows, tablefmt="simple")
    quality = c.quality_cost(s.truncated_fraction).describe()
    notes = list(wl.dataset.notes) + list(s.reasons) + [f"quality: {q}" for q in quality]
    if s.requirements_note:
        notes.append(s.requirements_note)
    if notes:
        out += "\n\n" + "\n".join(f"- {n}" for n in notes)
    return out


def render_report(s: Suggestion) -> str:
    """The summary, then every trial with its peak, tokens/s, status and the reason it lost."""
    from tabulate import tabulate  # lazy: loads tabulate

    kind = _kind(s)
    table = tabulate(trial_rows(s), headers=["#", "candidate", f"device GiB ({kind})", f"tokens/s ({kind})",
                                             "status", "source", "why"], tablefmt="simple")
    stored = sum(t.cached for t in s.trials)
    note = f"; {stored} answered from the stored study, not measured again" if stored else ""
    return render_summary(s) + f"\n\nTrials (fastest feasible first{note}):\n" + table


def plot(s: Suggestion, path: str | Path) -> Path:
    """Device peak against throughput: every measured trial, the feasible front and the budget line."""
    try:
        import matplotlib  # lazy: loads matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: loads matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'advisor[plot]'") from None
    limit = s.workload.limit_bytes
    pts = [(t.measurement.budget_bytes, t.measurement.tokens_per_second or 0.0, t.measurement.feasible(limit))
           for t in s.trials if t.measurement.budget_bytes is not None and t.measurement.status.value != "pruned"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [(d / _GiB, v) for d, v, f in pts if f]
    bad = [(d / _GiB, v) for d, v, f in pts if not f]
    if ok:
        ax.scatter(*zip(*ok, strict=True), s=18, c="tab:blue", label="fits")
    if bad:
        ax.scatter(*zip(*bad, strict=True), s=18, c="tab:red", marker="x", label="over the limit / OOM")
    front = [(t.measurement.budget_bytes / _GiB, t.measurement.tokens_per_second or 0.0) for t in s.front]
    if front:
        ax.plot(*zip(*front, strict=True), c="tab:green", drawstyle="steps-post", label="feasible front")
    ax.axvline(limit / _GiB, c="k", ls="--", lw=1, label=f"limit {limit / _GiB:.1f} GiB")
    ax.axvline(s.workload.budget_bytes / _GiB, c="gray", ls=":", lw=1, label="budget")
    ax.scatter([s.measurement.budget_bytes / _GiB], [s.measurement.tokens_per_second or 0], s=120,
               facecolors="none", edgecolors="tab:orange", lw=2, label="chosen")
    ax.set_xlabel("device peak (GiB)")
    ax.set_ylabel("trained tokens / s")
    ax.set_title(f"{s.workload.model.name} on {s.workload.gpu.name} ({s.measurement.source.value})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
