"""advisor: the fastest TRL fine-tuning configuration that fits your GPU's memory, measured.

Heavy modules (torch, transformers, trl, optuna) load only when a function that needs them is called.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # errors
    "AdvisorError": "errors", "UsageError": "errors", "ConfigError": "errors", "UnknownModelError": "errors",
    "UnknownGPUError": "errors", "ProfileError": "errors", "DatasetError": "errors", "BaselineError": "errors",
    "NoFitError": "errors", "BackendError": "errors", "RegressionError": "errors",
    # data types
    "Measurement": "measurement", "Status": "measurement", "Source": "measurement", "Category": "measurement",
    "Candidate": "space", "SearchSpace": "space", "QualityCost": "space", "PackingStrategy": "space",
    "Precision": "space", "WeightsDtype": "space", "Quantization": "space", "Optimizer": "space",
    "Attention": "space",
    "Workload": "workload", "ModelSpec": "workload", "GPUSpec": "workload", "Goals": "workload",
    "Method": "workload", "build_workload": "inputs", "WorkloadRef": "inputs",
    "TokenizedDataset": "data", "load_dataset": "data",
    "Suggestion": "suggestion", "Trial": "suggestion",
    "RunConfig": "emit", "load_run_config": "emit",
    # functions
    "resolve_model": "profiles", "resolve_gpu": "profiles",
    # the modules are named apart from their functions (estimator.py holds estimate, simulator.py simulate,
    # probing/ probe): a submodule import binds the module on the package and would shadow a function of its name
    "estimate": "estimator",
    "simulate": "simulator",
    "probe": "probing",
    "suggest": "search",
    "register_backend": "backends", "backend_names": "backends",
    "length_report": "lengths",
    "Baseline": "baseline", "load_baseline": "baseline",
    "CheckResult": "regress", "Verdict": "regress", "record_baseline": "regress", "check": "regress",
    "assert_peak_memory": "assertions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'advisor' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
