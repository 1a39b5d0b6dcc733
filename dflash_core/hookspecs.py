"""Every hook dflash-pipe calls, in one place.

Plugins implement any subset of these with ``@hookimpl`` on a module-level function whose
name matches. All names carry the ``dflash_pipe_`` prefix so that pluggy can reject typos
(an unknown ``dflash_pipe_*`` implementation is an error at registration time).
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "dflash_pipe"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dflash_pipe_register_stages(registry: Any) -> None:
    """Add stage classes with ``registry.add(StageClass)``.

    Called once per plugin when the plugin manager loads. Built-in stages use this hook too,
    so a third-party plugin is never second-class.
    """


@hookspec(firstresult=True)
def dflash_pipe_resolve_device(spec: str) -> str | None:
    """Map a ``device:`` string from the pipeline file to a torch device string.

    Return ``None`` to leave the spec to the next plugin (and finally the built-in rule:
    ``cpu``, ``cuda``, ``cuda:N``, ``mps``). Raise ``ValueError`` with a message to reject it.
    """


@hookspec
def dflash_pipe_add_commands(subparsers: Any, common: Any) -> None:
    """Add ``dflash-pipe`` commands: ``subparsers.add_parser(NAME, parents=[common], ...)`` and
    ``set_defaults(func=RUN)``, where ``RUN(args)`` returns the exit code.

    The engine's own commands run pipelines; a command that belongs to some stages (the built-in
    ``evaluate`` and ``plan``) comes with their plugin. Import heavy modules inside ``RUN``, so that
    ``dflash-pipe --help`` stays fast.
    """


@hookspec
def dflash_pipe_before_stage(stage: str, kind: str, impl: str, device: str) -> None:
    """A stage is about to start (after its inputs are ready)."""


@hookspec
def dflash_pipe_after_stage(stage: str, status: str, summary: dict[str, Any]) -> None:
    """A stage ended. ``status`` is ``done`` or ``cached``; ``summary`` is what it reported."""


@hookspec
def dflash_pipe_on_stage_error(stage: str, error: BaseException) -> None:
    """A stage raised (or its process died). The run is being stopped."""


@hookspec
def dflash_pipe_on_event(stage: str, event: dict[str, Any]) -> None:
    """A progress or metrics event a stage emitted with ``ctx.emit`` (``event["type"]`` says which)."""


@hookspec
def dflash_pipe_checkpoint_saved(stage: str, step: int, path: str) -> None:
    """A complete checkpoint now exists at ``path`` (a local path or fsspec URL)."""
