"""advisor: the fastest TRL fine-tuning configuration that fits your GPU's memory, measured.

Heavy modules (torch, transformers, trl, optuna) load only when a function that needs them is called.
"""

from __future__ import annotations

import sys
import types
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
    "estimate": "estimate",
    "simulate": "simulate",
    "probe": "probe",
    "suggest": "search",
    "register_backend": "backends", "backend_names": "backends",
    "length_report": "lengths",
    "Baseline": "baseline", "load_baseline": "baseline",
    "CheckResult": "regress", "Verdict": "regress", "record_baseline": "regress", "check": "regress",
    "assert_peak_memory": "regress",
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


class _Package(types.ModuleType):
    """`advisor.simulate`, `advisor.estimate` and `advisor.probe` are functions that share their module's name.

    Importing a submodule binds it on the package (`advisor.simulate = <module>`), which would shadow the
    public function; the public name wins, and the module stays reachable through `sys.modules`.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name, "").split(".")[0] == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
