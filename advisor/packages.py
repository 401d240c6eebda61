"""The optional packages a training run may need beyond torch, transformers, TRL and PEFT, declared once: their pip
names (what `Candidate.requirements()` lists and the YAML's header says to install) and how to tell whether a run
on this machine can import them.

Where the target is this machine (the local GPU, the host CPU, or a backend that runs the candidate here: the cuda
and cpu probes), the search leaves out every candidate that needs a package missing here, and says what
installing it would unlock (advisor/search/space.py `installed_space`); for another machine it keeps them, and
the answer says what that machine must have installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Package", "PACKAGES", "installed", "missing", "install_hint"]


@dataclass(frozen=True)
class Package:
    """A pip distribution, what it is for, and the check that a run here can import it (transformers' own check
    where transformers has one: it is what refuses the run)."""

    pip: str
    purpose: str
    check: Callable[[], bool]


def _spec(module: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(module) is not None


def _kernels() -> bool:
    """transformers' check that a `kernels` package of a version it supports is importable (use_kernels=True and
    the kernels-community/* attention load through it)."""
    from transformers.utils.import_utils import is_kernels_available  # lazy: loads transformers

    return bool(is_kernels_available())


def _flash_attn(version: int) -> Callable[[], bool]:
    """transformers' own check of the flash-attn distribution of that version (FLASH_ATTENTION_COMPATIBILITY_MATRIX
    `pkg_availability_check`); without it transformers loads the Hub kernel FLASH_ATTN_KERNEL_FALLBACK names
    through `kernels`, so either one lets the run start."""

    def check() -> bool:
        from transformers.modeling_flash_attention_utils import (  # lazy: loads transformers
            FLASH_ATTENTION_COMPATIBILITY_MATRIX,
        )

        return bool(FLASH_ATTENTION_COMPATIBILITY_MATRIX[version]["pkg_availability_check"]()) or _kernels()

    return check


PACKAGES: dict[str, Package] = {p.pip: p for p in (
    Package("bitsandbytes", "8-bit optimizers (adamw_bnb_8bit, paged_adamw_8bit) and 4/8-bit base weights (QLoRA)",
            _spec("bitsandbytes")),
    Package("kernels", "Hub kernels (use_kernels, kernels-community/* FlashAttention)", _kernels),
    Package("flash-attn", "attn_implementation=flash_attention_2", _flash_attn(2)),
    Package("flash-attn-3", "attn_implementation=flash_attention_3", _flash_attn(3)),
    Package("flash-attn-4", "attn_implementation=flash_attention_4", _flash_attn(4)),
    Package("deepspeed", "DeepSpeed ZeRO-2/3 (parallelism=zero*)", _spec("deepspeed")),
    Package("liger-kernel", "Liger's fused kernels (use_liger_kernel)", _spec("liger_kernel")),
    Package("vllm", "vLLM generation (use_vllm)", _spec("vllm")),
)}

_INSTALLED: dict[str, bool] = {}


def installed(pip: str) -> bool:
    """Whether a run on this machine can import `pip` (checked once per process). An undeclared name is checked as
    the module of the same name."""
    if pip not in _INSTALLED:
        package = PACKAGES.get(pip)
        check = package.check if package is not None else _spec(pip.replace("-", "_"))
        try:
            _INSTALLED[pip] = bool(check())
        except Exception:  # noqa: BLE001 (a broken install is not importable: the run would fail the same way)
            _INSTALLED[pip] = False
    return _INSTALLED[pip]


def missing(requirements: Iterable[str]) -> tuple[str, ...]:
    """The packages of `requirements` a run here cannot import, in order, each once."""
    return tuple(dict.fromkeys(p for p in requirements if not installed(p)))


def install_hint(packages: Iterable[str]) -> str:
    """`pip install a b` for the packages, each once."""
    return "pip install " + " ".join(dict.fromkeys(packages))
