"""A pytest helper over the regression checks: `assert_peak_memory` fails the calling test with the per-category
table (`render.py`) when a configuration's device peak exceeds a budget (`regress.py` measures it)."""

from __future__ import annotations

from pathlib import Path

from .emit import load_run_config
from .inputs import build_workload
from .measurement import Measurement
from .regress import DEFAULT_BACKEND, compare_rows, measure
from .render import format_bytes, render_table
from .space import Candidate

__all__ = ["assert_peak_memory"]


def assert_peak_memory(
    config: Candidate | str | Path,
    *,
    model: str,
    max_bytes: int,
    gpu: str = "cpu",
    dataset: str | None = None,
    backend: str = DEFAULT_BACKEND,
) -> Measurement:
    """Fail the calling test with the per-category table when the device peak exceeds `max_bytes`.

    `config` is a Candidate or a RUN.yaml path. The bytes the budget applies to (`Measurement.budget_bytes`: the
    device peak, else reserved, else allocated) are compared; on the CPU all three are the allocator's peak.
    Returns the measurement for further assertions.
    """
    if isinstance(config, Candidate):
        candidate = config
    else:
        candidate = load_run_config(config).candidate
    workload = build_workload(model, gpu=gpu, dataset=dataset)
    m = measure(workload, candidate, backend)
    if m.fits(max_bytes):
        return m
    peak = m.budget_bytes
    limits = {"peak_bytes": None, "reserved_bytes": None, "device_bytes": max_bytes}
    rows = compare_rows(limits, {}, m)
    head = (f"{m.source.value} run of {model} on {gpu} ended with status {m.status.value}: {m.message}"
            if not m.ok else f"the {m.source.value} run of {model} on {gpu} reported no peak memory"
            if peak is None else
            f"peak memory {format_bytes(peak)} ({peak} B) exceeds max_bytes {format_bytes(max_bytes)} "
            f"({max_bytes} B) by {format_bytes(peak - max_bytes)}")
    raise AssertionError(head + "\n" + render_table(rows, 0.0, reference="limit"))
