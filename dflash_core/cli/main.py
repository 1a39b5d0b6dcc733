"""Entry point: global options, dispatch, and the mapping of errors to exit codes.

Exit codes: 0 ok, 1 a stage failed, 2 configuration error (bad pipeline file, plugin
conflict), 4 refused (``--only``/``--from`` with missing or stale inputs), 130 / 143 stopped by
SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

from dflash_core import __version__
from dflash_core.cli.common import (EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_REFUSED, err_console,
                                    plugin_manager, setup_logging)
from dflash_core.interrupts import Stopped, exit_code, stop_on_signals

COMMANDS = ["run", "validate", "list_stages", "plugins", "graph", "status"]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The engine's commands, then those the plugins add (``dflash_pipe_add_commands``): plugins load
    first, from entry points and the ``-p`` options found in ``argv``."""
    parser = argparse.ArgumentParser(prog="dflash-pipe", description=(
        "Train DFlash speculative-decoding drafters online, as a DAG of stage plugins."))
    parser.add_argument("--version", action="version", version=f"dflash-pipe {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=0)
    common.add_argument("-q", "--quiet", action="store_true")
    common.add_argument("--traceback", action="store_true", help="show Python tracebacks")
    common.add_argument("-p", dest="plugin", action="append", metavar="MODULE|no:NAME",
                        help="load a plugin module by import path, or disable plugin NAME")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dflash_core.cli.{name}").add_parser(sub, common)
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("-p", dest="plugin", action="append")
    known, _ = early.parse_known_args(sys.argv[1:] if argv is None else argv)
    pm = plugin_manager(known)
    pm.hook.dflash_pipe_add_commands(subparsers=sub, common=common)
    parser.set_defaults(loaded_plugins=pm)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status; SIGINT / SIGTERM end any command with the
    signal's name and 128 + the signal (``run`` first lets training save: ``cli/run.py``)."""
    received: list[int] = []
    try:
        with stop_on_signals(received):
            return _command(argv, received)
    except KeyboardInterrupt as exc:  # Stopped, or a Ctrl-C that came before our handler
        signum = getattr(exc, "signum", signal.SIGINT)
        err_console.print(f"{signal.Signals(signum).name}: interrupted")
        return exit_code(signum)


def _command(argv: list[str] | None, received: list[int]) -> int:
    """One command; ``received`` lists the signals that arrived, so an error that a signal caused
    (its :class:`Stopped` replaced inside native code) ends the command as stopped."""
    from dflash_core.errors import PipelineFileError
    from dflash_core.plugins import PluginError
    from dflash_core.runner import Refused, RunFailed

    try:
        parser = build_parser(argv)
    except PluginError as exc:
        err_console.print(f"plugin error: {exc}", markup=False)
        return EXIT_CONFIG
    args = parser.parse_args(argv)
    setup_logging(-1 if args.quiet else args.verbose)

    try:
        return int(args.func(args) or 0)
    except PipelineFileError as exc:
        err_console.print(exc.format(), markup=False, soft_wrap=True)
        return EXIT_CONFIG
    except PluginError as exc:
        err_console.print(f"plugin error: {exc}", markup=False)
        return EXIT_CONFIG
    except Refused as exc:
        err_console.print(f"refused: {exc}", markup=False)
        return EXIT_REFUSED
    except RunFailed as exc:
        if args.traceback and exc.tb:
            err_console.print(exc.tb, markup=False)
        err_console.print(f"error: {exc}", markup=False, soft_wrap=True)  # paths stay whole
        if exc.log and not args.traceback:
            err_console.print(f"its traceback: {exc.log}", markup=False, soft_wrap=True)
        return EXIT_FAILED
    except Exception as exc:  # a bug or an environment problem: one line unless asked
        if received:
            raise Stopped(received[0]) from exc
        if args.traceback:
            traceback.print_exc()
        err_console.print(f"error: {type(exc).__name__}: {exc}", markup=False)
        return EXIT_FAILED


def entry() -> NoReturn:
    """The ``dflash-pipe`` program (console script, ``python -m dflash_core.cli.main``): :func:`main`,
    then :func:`exit_process`. Tests call :func:`main` in their own process instead."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``, also when a stopped or failed run left stage threads running.

    Threads cannot be killed: one inside a long torch call (a target forward, a decode) when a
    signal stopped the run is still there at exit, and the interpreter's shutdown ends such a
    thread from inside that native call, which aborts the process (``terminate called without an
    active exception``, SIGABRT) instead of exiting with ``code``. Then the exit handlers run (a
    plugin's, logging's) and the process ends without that shutdown."""
    if code == EXIT_OK or not any(t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
