"""Param validation against Config dataclasses (this module uses postponed annotations)."""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import pytest

from dflash_core.config_types import (REQUIRED, config_schema, field_types, param_help, plain, type_name,
                                      validate_params)
from dflash_core.errors import ConfigError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Inner:
    depth: int = 1
    name: str = "x"


@dataclass
class Cfg:
    model: str = field(metadata={"help": "HF model id"})
    lr: float = 1e-3
    steps: int = 10
    flag: bool = False
    mode: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=list)
    pair: tuple[int, str] = (1, "x")
    betas: tuple[float, ...] = (0.9,)
    extra: dict[str, int] = field(default_factory=dict)
    maybe: Optional[int] = None
    maybe2: float | None = None
    either: Union[int, str] = 0
    layers: str | list[str] = "auto"
    anything: Any = None
    inner: Inner = field(default_factory=Inner)
    color: Color = Color.RED
    derived: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        self.derived = self.steps * 2


def check(params):
    return validate_params(Cfg, params, owner="t:cfg")


def test_valid_values_are_converted():
    cfg, errors = check({
        "model": "m", "lr": "3e-4", "steps": 5, "flag": True, "mode": "b", "tags": ["x"],
        "pair": [2, "y"], "betas": [1, "2.5e-1"], "extra": {"k": 3}, "maybe": 4, "maybe2": 2,
        "either": "s", "layers": ["a", "b"], "anything": {"x": [1]}, "inner": {"depth": 3},
        "color": "blue"})
    assert errors == []
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)
    assert cfg.pair == (2, "y") and cfg.betas == (1.0, 0.25)
    assert cfg.maybe2 == 2.0 and isinstance(cfg.maybe2, float)
    assert cfg.inner == Inner(depth=3) and cfg.color is Color.BLUE and cfg.derived == 10
    assert cfg.layers == ["a", "b"] and cfg.either == "s" and cfg.anything == {"x": [1]}
    assert plain(cfg.inner) == {"depth": 3, "name": "x"} and plain(cfg.pair) == [2, "y"]
    assert plain(cfg.color) == "blue"


def test_defaults_and_none():
    cfg, errors = check({"model": "m", "maybe": None, "maybe2": None, "layers": "auto"})
    assert errors == [] and cfg.maybe is None and cfg.layers == "auto" and cfg.steps == 10


@pytest.mark.parametrize("params, mark, message", [
    ({"lr": "fast"}, "lr", "param 'lr' must be float, got str 'fast'"),
    ({"lr": True}, "lr", "param 'lr' must be float, got bool True"),
    ({"steps": 1.5}, "steps", "param 'steps' must be int, got float 1.5"),
    ({"steps": "3"}, "steps", "param 'steps' must be int, got str '3'"),
    ({"flag": 1}, "flag", "param 'flag' must be bool, got int 1"),
    ({"flag": "yes"}, "flag", "param 'flag' must be bool, got str 'yes'"),
    ({"model": 3}, "model", "param 'model' must be str, got int 3"),
    ({"mode": "c"}, "mode", "param 'mode' must be one of 'a', 'b', got str 'c'"),
    ({"tags": "x"}, "tags", "param 'tags' must be list[str], got str 'x'"),
    ({"tags": ["x", 2]}, "tags[1]", "param 'tags[1]' must be str, got int 2"),
    ({"pair": [1]}, "pair", "param 'pair' must be tuple[int, str], got list [1] (1 items, expected 2)"),
    ({"betas": [0.9, "x"]}, "betas[1]", "param 'betas[1]' must be float, got str 'x'"),
    ({"extra": {"k": "v"}}, "extra.k", "param 'extra.k' must be int, got str 'v'"),
    ({"extra": [1]}, "extra", "param 'extra' must be dict[str, int], got list [1]"),
    ({"maybe": "x"}, "maybe", "param 'maybe' must be int, got str 'x'"),
    ({"either": [1]}, "either", "param 'either' must be int | str, got list [1]"),
    ({"layers": [1]}, "layers", "param 'layers' must be str | list[str], got list [1]"),
    ({"inner": 3}, "inner", "param 'inner' must be a mapping, got int 3"),
    ({"inner": {"depht": 2}}, "inner.depht", "unknown param 'inner.depht' for t:cfg (did you mean 'inner.depth'?)"),
    ({"inner": {"depth": "deep"}}, "inner.depth", "param 'inner.depth' must be int, got str 'deep'"),
    ({"color": "green"}, "color", "param 'color' must be Color, got str 'green' (one of RED, BLUE)"),
    ({"stepz": 1}, "stepz", "unknown param 'stepz' for t:cfg (did you mean 'steps'?)"),
    ({"derived": 1}, "derived", "unknown param 'derived' for t:cfg"),
    ({"steps": -1}, "", "invalid params for t:cfg: steps must be >= 0"),
])
def test_errors(params, mark, message):
    cfg, errors = check({"model": "m", **params})
    assert cfg is None
    assert len(errors) == 1, errors
    assert errors[0][0] == mark
    assert errors[0][1].startswith(message)


def test_all_errors_collected_and_missing_required():
    cfg, errors = validate_params(Cfg, {"lr": "x", "steps": "y", "bogus": 1}, owner="t:cfg")
    assert cfg is None
    assert sorted(m for m, _ in errors) == ["", "bogus", "lr", "steps"]
    assert ("", "missing required param 'model' (str) for t:cfg") in errors


def test_mark_of_receives_path_and_where():
    seen = []

    def mark_of(path, where):
        seen.append((path, where))
        return (path, where)

    _, errors = validate_params(Cfg, {"model": "m", "typo": 1, "tags": [1]}, mark_of)
    assert [m for m, _ in errors] == [(("typo",), "key"), (("tags", 0), "value")]


def test_non_mapping_params():
    cfg, errors = validate_params(Inner, [1, 2], owner="k:n")
    assert cfg is None and errors == [("", "params of k:n must be a mapping, got list [1, 2]")]
    cfg, errors = validate_params(Inner, None)
    assert errors == [] and cfg == Inner()


def test_a_bare_on_or_off_that_yaml_made_a_boolean_is_the_switch_it_reads() -> None:
    """``compile: on`` in a pipeline file reaches the check as True: a Literal offering "on" and
    "off" takes the booleans as them; one that does not still refuses them."""
    import yaml

    @dataclass
    class Switches:
        compile: Literal["auto", "on", "off"] = "auto"
        mode: Literal["a", "b"] = "a"

    params = yaml.safe_load("compile: on")
    assert params == {"compile": True}
    assert validate_params(Switches, params, owner="t:s")[0].compile == "on"
    assert validate_params(Switches, {"compile": False}, owner="t:s")[0].compile == "off"
    _, errors = validate_params(Switches, {"mode": True}, owner="t:s")
    assert errors == [("mode", "param 'mode' must be one of 'a', 'b', got bool True")]


def test_union_prefers_exact_match():
    @dataclass
    class U:
        x: float | str = 0.0
        y: str | float = ""

    cfg, errors = validate_params(U, {"x": "abc", "y": "1e-3"})
    assert errors == [] and cfg.x == "abc" and cfg.y == "1e-3"
    cfg, _ = validate_params(U, {"x": "1e-3"})
    assert cfg.x == "1e-3"  # str matches exactly before the lenient float parse


def test_config_schema():
    rows = {r.name: r for r in config_schema(Cfg)}
    assert "derived" not in rows
    assert rows["model"] == ("model", "str", REQUIRED, "HF model id") and rows["model"].required
    assert rows["lr"][1:3] == ("float", 1e-3)
    assert rows["mode"].type == "'a' | 'b'"
    assert rows["maybe"].type == "int | None" and rows["maybe2"].type == "float | None"
    assert rows["layers"].type == "str | list[str]"
    assert rows["betas"].type == "tuple[float, ...]" and rows["tags"].default == []
    assert rows["extra"].type == "dict[str, int]" and rows["anything"].type == "any"
    assert rows["inner"].type == "Inner" and rows["inner"].default == Inner()
    assert repr(REQUIRED) == "required"
    assert type_name(Optional[list[int]]) == "list[int] | None"


@dataclass
class Opt:
    lr: float = field(default=1e-3, metadata={"help": "step size"})


@dataclass
class Helped:
    opt: Opt | None = field(default=None, metadata={"help": "the optimizer"})
    layers: list[int] = field(default_factory=list, metadata={"help": "layer ids"})


def test_param_help_follows_nested_dataclasses_and_skips_list_indices():
    assert param_help(Helped, ("opt", "lr")) == "step size"
    assert param_help(Helped, ("opt",)) == "the optimizer"
    assert param_help(Helped, ("layers", 2)) == "layer ids"
    assert param_help(Helped, ("nope",)) == "" and param_help(Helped, ()) == ""


def test_a_config_error_shows_the_help_under_the_caret():
    err = ConfigError("p.yaml", 3, 7, "param 'lr' must be float", "  lr: fast", "step size")
    assert err.format() == ("p.yaml:3:7: param 'lr' must be float\n      lr: fast\n          ^\n"
                            "    help: step size")
    assert str(err) == "p.yaml:3:7: param 'lr' must be float"


def test_every_built_in_stage_param_has_help():
    """The one convention: field(metadata={"help": ...}), which list-stages -v and validate show."""
    from dflash_core.plugins import PluginManager

    def undocumented(cls: type, prefix: str = "") -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            if not f.metadata.get("help"):
                out.append(prefix + f.name)
            inner = [t for t in (field_types(cls)[f.name], *typing.get_args(field_types(cls)[f.name]))
                     if dataclasses.is_dataclass(t)]
            out += [n for t in inner for n in undocumented(t, f"{prefix}{f.name}.")]
        return out

    missing = {":".join(key): undocumented(cls.Config)
               for key, cls in PluginManager(autoload=False).registry.items()}
    assert not any(missing.values()), missing
