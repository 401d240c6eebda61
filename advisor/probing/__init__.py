"""Real probes: a candidate measured with short real SFTTrainer steps in an isolated child process."""

from .runner import FAULT_ENV, PROBE_BACKENDS, PROBE_SOURCES, BatchKind, BatchPlan, plan_batches, probe

__all__ = ["FAULT_ENV", "PROBE_BACKENDS", "PROBE_SOURCES", "BatchKind", "BatchPlan", "plan_batches", "probe"]
