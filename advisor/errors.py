"""One exception hierarchy. The CLI maps `exit_code` to the process exit status."""

from __future__ import annotations

from collections.abc import Iterable


class AdvisorError(Exception):
    """Base of every error the advisor raises on purpose."""

    exit_code: int = 2


class UsageError(AdvisorError):
    """Bad input: an unknown name, a malformed file, contradictory flags (exit 2)."""


class ConfigError(UsageError):
    """One or more rules broken at once; every problem is reported, not just the first."""

    def __init__(self, problems: Iterable[str] | str, *, context: str = ""):
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        head = f"{context}: " if context else ""
        if len(self.problems) == 1:
            message = head + self.problems[0]
        else:
            message = head + f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class NotSimulated(ConfigError):
    """What the simulate backend does not run yet (`reason`), for a configuration the estimate's closed form covers:
    the simulate backend answers it with the estimate, saying so."""

    def __init__(self, reason: str, *, context: str = "simulate"):
        self.reason = reason
        super().__init__([f"{reason}; --backend estimate answers it in closed form"], context=context)


class UnknownModelError(UsageError):
    """A model id, directory or config.json that cannot be resolved."""


class UnknownGPUError(UsageError):
    """A --gpu name that matches no profile."""


class ProfileError(UsageError):
    """A file under profiles/ that is malformed."""


class DatasetError(UsageError):
    """A dataset that cannot be loaded or tokenized (names the row and the field)."""


class BaselineError(UsageError):
    """A baseline file that is missing, truncated or of an unknown schema."""


class NoFitError(AdvisorError):
    """A valid search whose answer is negative: no candidate fits the budget (exit 1).

    `details` keeps the facts as data (smallest device peak found, the limit, the next knob) for --json.
    """

    exit_code = 1

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details: dict = dict(details or {})


class BackendError(AdvisorError):
    """A valid search whose backend failed on every candidate it measured (exit 3): an error of the run, not
    "nothing fits" (no CUDA device, a missing package, a broken install). `details` keeps the facts as data."""

    exit_code = 3

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details: dict = dict(details or {})


class RegressionError(AdvisorError):
    """Peak memory grew beyond the tolerance of a baseline (exit 1)."""

    exit_code = 1
