"""`advisor` command line: a thin shell over the library.

Each sub-command lives in a module `cmd_<name>.py` of this package that defines `register(subparsers)`;
`register` adds a parser whose default `func` takes the parsed namespace and returns an exit code. The
library itself never sees an `argparse.Namespace` and never prints.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys
import traceback
import warnings
from typing import Any

from .. import __version__
from .. import _interrupt as interrupt
from ..errors import AdvisorError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="advisor",
        description="The fastest TRL fine-tuning configuration that fits your GPU's memory, measured.",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the versions and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser


class _Version(argparse.Action):
    """`advisor --version` on one line (argparse's own action wraps it to the terminal's width)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        print(_version())
        parser.exit(0)


def _version() -> str:
    """advisor's version and the libraries whose behaviour it models."""
    from .._versions import library_versions  # lazy: keeps start-up light

    libs = {k: v for k, v in library_versions().items() if k != "advisor"}
    return f"advisor {__version__} (" + ", ".join(f"{k} {v}" for k, v in libs.items()) + ")"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    args.argv = argv  # the command line as given (suggest's next step repeats it)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if not args.debug:
        # Deprecation chatter of transformers/TRL/PEFT inside a measurement is not the user's business.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(transformers|trl|peft|torch)\.")
    previous = _terminate_as_interrupt()
    restore_int = _interrupt_never_lost()
    try:
        code = int(args.func(args))
        if interrupt.requested():  # a Ctrl-C swallowed where it landed, after the last safe point
            raise KeyboardInterrupt
        return code
    except AdvisorError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"advisor {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"advisor {args.command}: interrupted; finished trials are kept", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"advisor {args.command}: terminated; finished trials are kept", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        restore_int()


def _interrupt_never_lost() -> Any:
    """SIGINT for the command's duration: KeyboardInterrupt as Python raises it, and the request recorded
    (advisor._interrupt) so that one swallowed where it landed (a weakref callback, a __del__) still ends the run
    at the search's next safe point, or when the command returns; such a swallowed one is not printed as
    "Exception ignored in ...". Returns what restores the previous handlers."""
    interrupt.clear()
    previous_hook = sys.unraisablehook

    def on_sigint(signum: int, frame: Any) -> None:
        interrupt.request()
        raise KeyboardInterrupt

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and interrupt.requested():
            return  # recorded: the run ends at the next safe point
        previous_hook(unraisable)

    try:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started to ignore it (nohup, `&`): keep that
            return lambda: None
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread
        return lambda: None
    sys.unraisablehook = hook

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        interrupt.clear()

    return restore


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that `with` blocks close what they opened (the simulator's worker
    processes and their server) and the running trial is failed for a rerun, as on Ctrl-C."""


def _terminate_as_interrupt() -> Any:
    """SIGTERM's handler for the command's duration (main thread only; None where it cannot be set)."""
    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    try:
        return signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread (main() called from a thread)
        return None


if __name__ == "__main__":
    sys.exit(main())
