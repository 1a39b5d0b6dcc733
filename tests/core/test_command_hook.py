"""``dflash_pipe_add_commands``: a plugin adds ``dflash-pipe`` commands. A module given with
``-p module`` (a real file on ``sys.path``) adds one that runs, the built-in plugin adds
``evaluate`` and ``plan`` the same way, and ``-p no:builtin`` takes those away."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dflash_core.cli.main import build_parser, main
from dflash_core.plugins import BUILTIN_PLUGIN
from tests.conftest import REPO, CLIResult, cli_env

PLUGIN = "dflash_test_commands"
SOURCE = '''
import os
import signal

from dflash_core import hookimpl


def _hello(args):
    print(f"hello {args.name} x{args.times}")
    return 3


class _SignalledSequence:
    """A sequence whose reading sends this process SIGTERM: torch reads it in native code."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        if i >= 2:
            raise IndexError(i)
        os.kill(os.getpid(), signal.SIGTERM)
        return 1.0


def _signalled(args):
    import torch

    torch.tensor(_SignalledSequence())  # the handler's exception comes back as torch's ValueError
    return 0


class _Anything:
    pass


def _signalled_in_a_callback(args):
    import time
    import weakref

    def callback(ref):
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, and Python drops what it raises

    thing = _Anything()
    ref = weakref.ref(thing, callback)
    del thing
    deadline = time.time() + 10
    while time.time() < deadline:  # the command's own work goes on (a decode, say)
        time.sleep(0.01)
    print("not stopped")
    return 0


@hookimpl
def dflash_pipe_add_commands(subparsers, common):
    p = subparsers.add_parser("hello", parents=[common], help="greet NAME (a test plugin's command)")
    p.add_argument("name")
    p.add_argument("--times", type=int, default=1)
    p.set_defaults(func=_hello)
    subparsers.add_parser("signalled", parents=[common]).set_defaults(func=_signalled)
    subparsers.add_parser("signalled-in-a-callback", parents=[common]).set_defaults(func=_signalled_in_a_callback)
'''


def commands(argv: list[str]) -> set[str]:
    """The commands ``dflash-pipe`` offers with these options (``-p`` ones count)."""
    parser = build_parser(argv)
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


@pytest.fixture
def command_plugin(tmp_path, monkeypatch):
    (tmp_path / f"{PLUGIN}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop(PLUGIN, None)


@pytest.fixture
def cli_exits(capsys, monkeypatch):
    """``main(argv)`` for commands that may end in argparse's ``SystemExit`` (``--help``, a bad
    command): the exit code either way, and what was printed."""
    monkeypatch.setenv("COLUMNS", "250")

    def run(*argv: str) -> CLIResult:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return CLIResult(code, captured.out, captured.err)

    return run


def test_plugin_command_runs_and_returns_its_exit_code(command_plugin, cli_exits):
    res = cli_exits("hello", "-p", PLUGIN, "world", "--times", "2")
    assert res.code == 3, res.text
    assert "hello world x2" in res.out

    res = cli_exits("hello", "-p", PLUGIN, "--help")
    assert res.code == 0, res.text
    assert "--times" in res.out and "--traceback" in res.out  # its own options and the common ones

    assert "hello" in commands(["-p", PLUGIN])
    assert "hello" not in commands([])  # not loaded: no such command
    res = cli_exits("hello", "world")
    assert res.code == 2 and "invalid choice: 'hello'" in res.err, res.text


def test_plugin_command_runs_from_the_installed_entry_point(command_plugin):
    """The same through a fresh ``dflash-pipe`` process, the plugin found on PYTHONPATH."""
    proc = subprocess.run([sys.executable, "-m", "dflash_core.cli.main", "hello", "-p", PLUGIN, "there"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=cli_env([command_plugin]))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "hello there x1" in proc.stdout


def test_a_signal_that_native_code_turns_into_an_error_still_stops_the_command(command_plugin, cli_exits):
    """SIGTERM while torch reads a Python sequence (as it does loading weights): torch replaces the
    handler's exception with a ValueError of its own, and the command still ends as stopped, 143
    with the signal's name, not as that error."""
    res = cli_exits("signalled", "-p", PLUGIN)
    assert res.code == 143, res.text
    assert "SIGTERM: interrupted" in res.err
    assert "ValueError" not in res.text


def test_a_signal_whose_exception_python_drops_still_stops_the_command(command_plugin, cli_exits):
    """SIGTERM while the main thread runs a weakref callback (as garbage collection does at any
    moment): Python drops the handler's exception there. The command still ends as stopped, 143,
    within the 10 s it would otherwise go on for. (Seen in a fresh clone: evaluate went on decoding
    after SIGTERM until the test killed it.)"""
    res = cli_exits("signalled-in-a-callback", "-p", PLUGIN)
    assert res.code == 143, res.text
    assert "SIGTERM: interrupted" in res.err
    assert "not stopped" not in res.out and "Exception ignored" not in res.err


@pytest.mark.parametrize("command, option", [("evaluate", "--num-prompts"), ("plan", "--rates")])
def test_builtin_commands_come_through_the_hook_and_go_with_their_plugin(cli_exits, command, option):
    res = cli_exits(command, "--help")
    assert res.code == 0, res.text
    assert option in res.out

    res = cli_exits(command, "--help", "-p", f"no:{BUILTIN_PLUGIN}")
    assert res.code == 2, res.text
    assert f"invalid choice: '{command}'" in res.err
    remaining = commands(["-p", f"no:{BUILTIN_PLUGIN}"])
    assert command not in remaining and {"run", "validate", "status"} <= remaining  # the engine's stay


def test_a_command_loads_the_plugins_once(command_plugin, cli_exits, monkeypatch):
    """The manager that collected the plugins' commands is the one the command uses."""
    from dflash_core.cli import common

    made: list[object] = []

    class Counted(common.PluginManager):
        def __init__(self, *a, **kw):
            made.append(self)
            super().__init__(*a, **kw)

    monkeypatch.setattr(common, "PluginManager", Counted)
    res = cli_exits("plugins", "-p", PLUGIN)
    assert res.code == 0, res.text
    assert PLUGIN in res.out and len(made) == 1
