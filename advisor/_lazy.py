"""The private packages' lazy surface (advisor/simulator, advisor/physics): each declares `_EXPORTS` (public name ->
(module inside the package, attribute)) and gets its module `__getattr__` / `__dir__` from here, so importing the
package costs nothing and a name is loaded from its module on first use (PEP 562)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, tuple[str, str]], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose globals are `namespace` (a loaded name is kept there)."""
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{where[0]}", package), where[1])
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__
