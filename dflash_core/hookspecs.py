"""Every hook dflash-pipe calls, in one place.

Plugins implement any subset of these with ``@hookimpl`` on a module-level function whose
name matches. All names carry the ``dflash_pipe_`` prefix so that pluggy can reject typos
(an unknown ``dflash_pipe_*`` implementation is an error at registration time).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # plugins.py imports this module: the name is for readers and type checkers
    from dflash_core.plugins import StageRegistry
    from dflash_core.vocabulary import Status

PROJECT = "dflash_pipe"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dflash_pipe_register_stages(registry: StageRegistry) -> None:
    """Register the plugin's stage classes.

    Called once per plugin when the plugin manager loads. The built-in stages come through this
    hook too, so a third-party plugin is never second-class.

    :param registry: Where stages are added, ``registry.add(StageClass)``; a class with a
        missing ``kind``/``name``, a ``Config`` that is not a dataclass or a ``kind:name``
        another plugin already took is refused with a :class:`~dflash_core.plugins.PluginError`.
    """


@hookspec(firstresult=True)
def dflash_pipe_resolve_device(spec: str) -> str | None:
    """Map a ``device:`` string from the pipeline file to a torch device string.

    Stops at the first plugin that returns a value; the built-in rule (``cpu``, ``cuda``,
    ``cuda:N``, ``mps``, ``cuda:{local_rank}``) comes last.

    :param spec: The ``device:`` value as written in the file (or a ``--set``).
    :returns: The torch device string, or ``None`` to leave ``spec`` to the next plugin.
    :raises ValueError: To refuse ``spec``; the message is shown at the value's file:line.
    """


@hookspec
def dflash_pipe_add_commands(subparsers: argparse._SubParsersAction,
                             common: argparse.ArgumentParser) -> None:
    """Add ``dflash-pipe`` commands.

    The engine's own commands run pipelines; a command that belongs to some stages (the
    built-in ``evaluate`` and ``plan``) comes with their plugin. Import heavy modules inside
    the command's function, so that ``dflash-pipe --help`` stays fast.

    :param subparsers: The CLI's subcommands: ``subparsers.add_parser(NAME, parents=[common],
        help=...)``, then ``set_defaults(func=RUN)`` where ``RUN(args)`` returns the exit code.
    :param common: The parser of the options every command takes (``-v``, ``-q``,
        ``--traceback``, ``-p``); pass it as a parent so that the new command takes them too.
    """


@hookspec
def dflash_pipe_before_stage(stage: str, kind: str, impl: str, device: str) -> None:
    """A stage is about to start: its inputs are ready, its worker is made.

    Not called for a stage skipped as cached.

    :param stage: The stage's name in the pipeline file (``tokenize``).
    :param kind: Its role (``tokenize``, or a plugin's own kind).
    :param impl: The implementation running it, ``kind:name`` (``tokenize:chat_template``).
    :param device: The resolved torch device string (``cpu``, ``cuda:0``).
    """


@hookspec
def dflash_pipe_after_stage(stage: str, status: Status, summary: dict[str, Any]) -> None:
    """A stage ended well: it ran to its end, or was found fresh and not run.

    A stage that fails reaches :func:`dflash_pipe_on_stage_error` instead.

    :param stage: The stage's name in the pipeline file.
    :param status: ``Status.DONE`` or ``Status.CACHED``; a ``str`` enum, equal to ``"done"`` and
        ``"cached"``.
    :param summary: The figures the stage put in ``ctx.summary`` (records in and out, tokens,
        …), or, when cached, those stored with its artifact.
    """


@hookspec
def dflash_pipe_on_stage_error(stage: str, error: BaseException) -> None:
    """A stage raised. The run is being stopped, and fails with this stage's error unless
    another is its cause (a stage that only saw its peer die is not).

    Not called when a stage's process dies without raising (killed by a signal).

    :param stage: The stage's name in the pipeline file.
    :param error: The exception the stage raised. From a process executor it is rebuilt from a
        pickle; one that cannot be rebuilt arrives as :class:`dflash_core.events.StageError`,
        which keeps its type's name (``type_name``) and its traceback text (``traceback``).
    """


@hookspec
def dflash_pipe_on_event(stage: str, event: dict[str, Any]) -> None:
    """A stage emitted an event with ``ctx.emit`` (``ctx.progress`` emits progress events).

    Called in the main process, whatever executor runs the stage, in the order emitted.

    :param stage: The stage's name in the pipeline file.
    :param event: The event; ``event["type"]`` says which: ``progress`` (``advance``,
        ``unit``, optional ``total``, ``start`` and counters), ``metrics`` (name -> number),
        ``checkpoint`` (``step``, ``path``), ``log`` (``message``) or a plugin's own type.
    """


@hookspec
def dflash_pipe_checkpoint_saved(stage: str, step: int, path: str) -> None:
    """A complete checkpoint now exists (it is never called for a partial one).

    :param stage: The name of the stage that saved it (the checkpoint stage).
    :param step: The optimizer step the checkpoint holds.
    :param path: Its directory: a local path or an fsspec URL.
    """
