"""The search's private package: the loop, the proposers, the evaluator and its pool, the fidelity correction,
liveness, study naming and storage, the default space, the ledger and the answer.

Only the names in `__all__` may be used outside this package (`from advisor._search import X`, or `from ._search
import X` inside advisor); its modules are its insides, free to change. The public way in is `advisor.search`,
which re-exports what callers, tools and tests use. tests/test_privacy.py fails on an import of a module of this
package from outside it.

Each name is imported from its module on first use (PEP 562): importing the package costs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# name -> (module of this package, the name there)
_EXPORTS: dict[str, tuple[str, str]] = {
    # ---- one method's study: the loop and what a search makes of it (loop.py, proposers.py, answer.py) -----------
    "StudyRun": ("loop", "StudyRun"),
    "fit_check": ("proposers", "fit_check"),  # measure a few the estimate says fit, before giving up on a method
    "confirmed_best": ("answer", "confirmed_best"),
    "confirmation_note": ("answer", "confirmation_note"),
    "build_suggestion": ("answer", "build_suggestion"),
    "smallest": ("answer", "smallest"),
    "next_knob": ("answer", "next_knob"),
    "no_fit_message": ("answer", "no_fit_message"),
    "empty_message": ("answer", "empty_message"),
    "raise_if_backend_failed": ("answer", "raise_if_backend_failed"),
    "not_installed": ("answer", "not_installed"),  # what installing a missing package would unlock, and its gain
    # ---- measuring: the evaluator's pool, failures, the pools (evaluator.py, pool.py) -----------------------------
    "open_search_pool": ("evaluator", "_open_pool"),  # the pool a search measures through (SerialPool for objects)
    "SerialPool": ("evaluator", "SerialPool"),
    "failure_reason": ("evaluator", "failure_reason"),
    "PRUNE_FACTOR": ("evaluator", "PRUNE_FACTOR"),  # the estimate prunes what it puts over limit x this
    "open_pool": ("pool", "open_pool"),
    "InProcessPool": ("pool", "InProcessPool"),
    "ProcessPool": ("pool", "ProcessPool"),
    "check_jobs": ("pool", "check_jobs"),
    "default_jobs": ("pool", "default_jobs"),
    "messages_of": ("pool", "messages_of"),
    "prestarted": ("pool", "prestarted"),  # the workers' server started ahead of the pool (the CLI's front door)
    "walk_parameters": ("proposers", "walk_parameters"),  # a sweep's NEIGHBOUR_PARENTS x SEEDS, for a block
    # ---- the estimate corrected by measured points (fidelity.py) ---------------------------------------------------
    "Correction": ("fidelity", "Correction"),
    "fit_correction": ("fidelity", "fit"),
    "cannot_win": ("fidelity", "cannot_win"),
    "FIDELITY_SHRINK": ("fidelity", "SHRINK"),  # pseudo-points at ratio 1
    "FIDELITY_FLOOR": ("fidelity", "FLOOR"),  # the best resolution claimed
    "FIDELITY_MIN_POINTS": ("fidelity", "MIN_POINTS"),  # fewer measured points: no skipping
    # ---- what was measured (ledger.py) -----------------------------------------------------------------------------
    "candidate_key": ("ledger", "candidate_key"),
    "device_bytes": ("ledger", "device_bytes"),
    "feasible": ("ledger", "feasible"),
    "needs_at_least": ("ledger", "needs_at_least"),
    # ---- the space: defaults, --fix, the effective batch (space.py, params.py) -------------------------------------
    "RowTokens": ("space", "RowTokens"),
    "default_space": ("space", "default_space"),
    "default_tokens_per_step": ("space", "default_tokens_per_step"),
    "accumulation_for": ("space", "accumulation_for"),
    "with_accumulation": ("space", "with_accumulation"),
    "parse_fix": ("space", "parse_fix"),
    "apply_pins": ("space", "apply_pins"),
    "installed_space": ("space", "installed_space"),  # a run here: without what needs a missing package
    "value_requirements": ("space", "value_requirements"),
    "method_order": ("space", "method_order"),
    "StudySpace": ("params", "StudySpace"),
    "space_from_json": ("params", "space_from_json"),
    "NO_ACCUMULATION": ("params", "NO_ACCUMULATION"),
    # ---- studies: names, specs, storage, liveness, workers (naming.py, storage.py, liveness.py, worker.py) --------
    "study_name": ("naming", "study_name"),
    "study_spec": ("naming", "spec"),  # what a study was made for, stored under SPEC_KEY
    "SPEC_KEY": ("naming", "SPEC_KEY"),
    "study_names": ("naming", "study_names"),
    "open_store": ("naming", "open_store"),
    "create_study": ("naming", "create_study"),
    "drop_failed_study": ("naming", "drop_failed_study"),
    "cache_dir": ("storage", "cache_dir"),
    "open_cache": ("storage", "open_cache"),
    "open_given": ("storage", "open_given"),
    "after_failure": ("storage", "after_failure"),
    "open_for_reading": ("storage", "open_for_reading"),
    "is_storage_failure": ("storage", "is_storage_failure"),
    "open_storage": ("storage", "open_storage"),
    "HEARTBEAT_S": ("liveness", "HEARTBEAT_S"),
    "STALE_S": ("liveness", "STALE_S"),
    "work": ("worker", "work"),
    # ---- stored searches shown again, a worker's side of a shared study (stored.py) ---------------------------------
    "StoredStudy": ("stored", "StoredStudy"),
    "stored_studies": ("stored", "stored_studies"),
    "stored_suggestion": ("stored", "stored_suggestion"),
    "run_worker": ("stored", "run_worker"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
