"""Rendering of results as text, tables and Markdown: the types (Measurement, CheckResult, Baseline) hold the
numbers, these functions only show them (as torch.utils.benchmark's `Compare` renders its `Measurement`s).

`report.py` is the suggestion's part of this family (its table, summary and plot).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .report import time_lines

if TYPE_CHECKING:
    from .baseline import Baseline
    from .measurement import Measurement
    from .regress import CheckResult, Row

_GiB = 2**30


def format_bytes(n: int | None, signed: bool = False) -> str:
    """3221225472 -> '3.00 GiB'; with `signed` a positive difference gets a '+'."""
    if n is None:
        return "-"
    sign = ("+" if n > 0 else "-" if n < 0 else "") if signed else ("-" if n < 0 else "")
    v = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{sign}{v / scale:.2f} {unit}"
    return f"{sign}{v} B"


def _gib(n: int | None, digits: int = 3) -> str:
    return "-" if n is None else f"{n / _GiB:.{digits}f} GiB"


# ---- regression checks -----------------------------------------------------------------------------------------

def render_table(rows: Sequence[Row], tolerance: float, *, tablefmt: str = "simple",
                 reference: str = "baseline") -> str:
    """The per-metric table shared by `advisor check`, its Markdown summary and `assert_peak_memory`."""
    from tabulate import tabulate  # lazy: loads tabulate

    from .baseline import TOTALS  # lazy: loads numpy

    body = []
    for r in rows:
        if r.grew(tolerance):
            flag = "over" if r.metric in TOTALS else "grew"
        elif r.shrank(tolerance):
            flag = "shrank"
        else:
            flag = ""
        change = "-" if r.change is None else f"{r.change:+.2%}"
        body.append([r.metric, format_bytes(r.reference), format_bytes(r.now), format_bytes(r.difference, True),
                     change, flag])
    headers = ["", reference, "now", "difference", "change", ""]
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def check_verdict(result: CheckResult) -> str:
    """One line: the outcome of the check in words."""
    from .regress import Verdict  # lazy: loads numpy

    outcome, tol = result.outcome, result.tolerance
    if outcome is Verdict.FAILED:
        return f"REGRESSION: the run now ends with status {result.measurement.status.value}"
    if outcome is Verdict.REGRESSED:
        return f"REGRESSION: peak memory grew by more than {tol:.2%} ({', '.join(result.grown)})"
    if outcome is Verdict.IMPROVED:
        return f"within tolerance ({tol:.2%}); memory shrank beyond it: record a new baseline to lock the gain in"
    return f"within tolerance ({tol:.2%})"


def check_table(result: CheckResult, tablefmt: str = "simple") -> str:
    return render_table(result.rows, result.tolerance, tablefmt=tablefmt)


def check_explanation(result: CheckResult) -> list[str]:
    """The lines printed under the table: library changes first, since they are the usual cause."""
    out = []
    if result.version_changes:
        out.append("library versions changed since the baseline (the usual cause): "
                   + ", ".join(str(v) for v in result.version_changes))
    out.extend(result.notes)
    if result.measurement.message:
        out.append(f"measurement: {result.measurement.message}")
    return out


def check_text(result: CheckResult) -> str:
    lines = [check_verdict(result), "", check_table(result), ""]
    lines.extend(check_explanation(result))
    return "\n".join(lines).rstrip() + "\n"


def check_markdown(result: CheckResult) -> str:
    title = "Peak-memory check: " + ("regression" if result.regressed else "ok")
    b = result.baseline
    lines = [f"### {title}", "", check_verdict(result), "",
             f"backend `{b.backend}`, model `{b.workload.model}`, target `{b.workload.gpu}`", "",
             check_table(result, "github"), ""]
    lines.extend(f"- {line}" for line in check_explanation(result))
    return "\n".join(lines).rstrip() + "\n"


def baseline_text(baseline: Baseline, path: str | Path, target: str) -> str:
    """What `advisor baseline` prints after writing the file."""
    lines = [f"wrote {path}: {baseline.backend} backend, {baseline.workload.model} on {target}",
             f"  peak_bytes     {format_bytes(baseline.peak_bytes):>12}  ({baseline.peak_bytes} B)",
             f"  reserved_bytes {format_bytes(baseline.reserved_bytes):>12}",
             f"  device_bytes   {format_bytes(baseline.device_bytes):>12}"]
    lines += [f"    {name:<18} {format_bytes(n):>12}" for name, n in baseline.breakdown.items()]
    lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in baseline.versions.items()))
    return "\n".join(lines)


# ---- one measurement -------------------------------------------------------------------------------------------

def probe_text(m: Measurement) -> str:
    """What `advisor probe` prints."""

    def gib(n: int | None) -> str:
        return "-" if n is None else f"{n / _GiB:.3f} GiB ({n} bytes)"

    lines = [f"status: {m.status.value}  (source: {m.source.value})"]
    if m.message:
        lines.append(f"message: {m.message}")
    if m.ok:
        lines += [
            f"peak allocated: {gib(m.peak_bytes)}",
            f"peak reserved:  {gib(m.reserved_bytes)}",
            f"device peak:    {gib(m.device_bytes)}",
            f"step time:      {m.step_time_s:.3f} s" if m.step_time_s is not None else "step time: -",
            f"throughput:     {m.tokens_per_second:.1f} trained tokens/s" if m.tokens_per_second else "throughput: -",
            f"peak set by:    {m.peak_batch}",
        ]
        for k, v in m.breakdown.items():
            lines.append(f"  {k}: {v / 2**20:.1f} MiB")
    lines += [f"note: {n}" for n in m.notes]
    return "\n".join(lines)


def simulate_text(m: Measurement, budget_bytes: int) -> str:
    """What `advisor simulate` prints: the peaks, the breakdown largest first, the time terms, the notes."""
    lines = [f"status        {m.status.value}  (source: {m.source.value})"]
    if m.message and not m.ok:
        lines.append(f"message       {m.message}")
    lines += [f"peak_bytes    {_gib(m.peak_bytes)}",
              f"reserved      {_gib(m.reserved_bytes)}",
              f"device_bytes  {_gib(m.device_bytes)}  (budget {budget_bytes / _GiB:.2f} GiB)"]
    lines += [f"  {cat:<18}{_gib(n)}" for cat, n in sorted(m.breakdown.items(), key=lambda kv: -kv[1])]
    lines += time_lines(m)
    lines += [f"note: {note}" for note in m.notes]
    return "\n".join(lines)
