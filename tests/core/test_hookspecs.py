"""The hook specifications are the plugin API's reference: every parameter typed and documented."""

from __future__ import annotations

import inspect
import typing

import pytest

from dflash_core import hookspecs

SPECS = [f for name, f in vars(hookspecs).items() if name.startswith("dflash_pipe_")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda f: f.__name__)
def test_every_hook_parameter_is_typed_and_documented(spec):
    hints = typing.get_type_hints(spec, vars(hookspecs) | _checking_names())
    doc = inspect.getdoc(spec) or ""
    for name in inspect.signature(spec).parameters:
        assert hints.get(name) not in (None, typing.Any), f"{spec.__name__}({name}) is untyped"
        assert f":param {name}:" in doc, f"{spec.__name__} does not document {name}"


def _checking_names() -> dict[str, object]:
    """The names hookspecs.py imports for type checkers only."""
    from dflash_core.plugins import StageRegistry
    from dflash_core.vocabulary import Status

    return {"StageRegistry": StageRegistry, "Status": Status}
