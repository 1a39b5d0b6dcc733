"""Check a stage's ``params:`` against its ``Config`` dataclass and describe the dataclass.

This knows nothing about YAML: the caller passes ``mark_of(path, where)`` to turn a param path
(``("opt", "lr")``, ``("layers", 2)``; ``()`` for the params mapping itself) into whatever it
uses for positions, and gets back ``(mark, message)`` pairs. Values come from
``yaml.safe_load`` (or a ``--set``), so the checks follow what YAML produces:

* ``bool`` is strict (``0``/``1`` are not booleans, and ``true`` is not an int);
* a ``float`` field accepts ints and strings that parse as floats, because PyYAML reads
  ``3e-4`` (no dot) as the string ``'3e-4'``;
* ``tuple[...]`` and ``set[...]`` fields accept YAML lists; a nested dataclass accepts a mapping;
* a ``Literal`` offering ``"on"`` / ``"off"`` takes ``True`` / ``False`` as them: YAML reads a bare
  ``compile: on`` as a boolean;
* ``Optional``/``X | None``, ``Union``, ``Literal``, ``list``, ``dict``, ``Any`` are supported;
  unions try exact matches before lenient ones (``float | str`` keeps ``'abc'`` a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import pathlib
import types
import typing
from collections import abc
from typing import Any, Callable, NamedTuple

MarkOf = Callable[[tuple, str], Any]
"""``mark_of(path, where)`` with ``where`` in ``"key"``, ``"value"``."""

_FAIL = object()


class _Required:
    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()
"""Default shown by :func:`config_schema` for a field without a default."""


class ParamInfo(NamedTuple):
    """One row of ``dflash-pipe list-stages``: a param, its type, default and help text."""

    name: str
    type: str
    default: Any
    doc: str

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def did_you_mean(word: Any, choices: typing.Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def type_name(tp: Any) -> str:
    """Readable type (``int``, ``str | None``, ``list[int]``, ``'fast' | 'slow'``)."""
    if tp is Any or tp is object:
        return "any"
    if tp is type(None) or tp is None:
        return "None"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        base = getattr(origin, "__name__", str(origin))
        if not args:
            return base
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{base}[{inner}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def field_types(config_cls: type) -> dict[str, Any]:
    """Resolved type of each field (works with ``from __future__ import annotations``)."""
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # an unresolvable annotation: check what can be checked
        hints = {}
    out = {}
    for f in dataclasses.fields(config_cls):
        tp = hints.get(f.name, f.type)
        out[f.name] = Any if isinstance(tp, str) else tp
    return out


def _init_fields(config_cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config_cls) if f.init]


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def field_help(f: dataclasses.Field) -> str:
    """A Config field's help: ``field(metadata={"help": …})``, the one way a stage documents a
    param. Being data on the field, it is there wherever the class is (no source file needed)."""
    return str(f.metadata.get("help", ""))


def param_help(config_cls: type, path: tuple) -> str:
    """The help of the param at ``path`` (``("opt", "lr")``; list indices are skipped), through
    nested dataclasses; empty when the path names no documented field."""
    found, cls = "", config_cls
    for key in path:
        if isinstance(key, int):
            continue
        fields = {f.name: f for f in _init_fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if key not in fields:
            break
        found = field_help(fields[key])
        cls = _nested_dataclass(field_types(cls)[key])
    return found


def _nested_dataclass(tp: Any) -> type | None:
    """The dataclass a field holds (``Inner``, ``Inner | None``), else None."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t
    return None


def config_schema(config_cls: type, nested: bool = False, prefix: str = "") -> list[ParamInfo]:
    """``(name, type string, default, help)`` per init field (:func:`field_help`).

    A field without default has ``default`` :data:`REQUIRED`. ``nested``: a field holding a
    dataclass is followed by that dataclass's fields, named ``field.sub``.
    """
    hints = field_types(config_cls)
    rows = []
    for f in _init_fields(config_cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            try:
                default = f.default_factory()
            except Exception:
                default = REQUIRED
        else:
            default = REQUIRED
        rows.append(ParamInfo(prefix + f.name, type_name(hints[f.name]), default, field_help(f)))
        inner = _nested_dataclass(hints[f.name]) if nested else None
        if inner is not None:
            rows += config_schema(inner, nested, f"{prefix}{f.name}.")
    return rows


def _path_str(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    kind = "null" if value is None else type(value).__name__
    return kind if value is None else f"{kind} {text}"


class _Checker:
    def __init__(self, mark_of: MarkOf | None, owner: str) -> None:
        self.mark_of = mark_of or (lambda path, where: _path_str(path))
        self.owner = owner
        self.errors: list[tuple[Any, str]] = []

    def error(self, path: tuple, where: str, message: str) -> None:
        self.errors.append((self.mark_of(path, where), message))

    def mismatch(self, path: tuple, tp: Any, value: Any, extra: str = "") -> Any:
        self.error(path, "value",
                   f"param '{_path_str(path)}' must be {type_name(tp)}, got {_show(value)}{extra}")
        return _FAIL

    # -- dataclasses -----------------------------------------------------------------------
    def dataclass(self, cls: type, values: Any, path: tuple) -> Any:
        if values is None:
            values = {}
        if not isinstance(values, dict):
            what = f"params of {self.owner}" if not path and self.owner else (
                f"param '{_path_str(path)}'" if path else "params")
            self.error(path, "value", f"{what} must be a mapping, got {_show(values)}")
            return _FAIL
        fields = {f.name: f for f in _init_fields(cls)}
        hints = field_types(cls)
        kwargs: dict[str, Any] = {}
        ok = True
        where = f" for {self.owner}" if self.owner else ""
        for key, value in values.items():
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
                hint = (f" (did you mean '{_path_str(path + (close[0],))}'?)" if close else "") or (
                    f" (params: {', '.join(fields)})" if fields else " (it takes no params)")
                self.error(path + (key,), "key",
                           f"unknown param '{_path_str(path + (key,))}'{where}{hint}")
                ok = False
                continue
            converted = self.value(value, hints[key], path + (key,))
            if converted is _FAIL:
                ok = False
            else:
                kwargs[key] = converted
        for name, f in fields.items():
            if name not in values and not _has_default(f):
                self.error(path, "value", f"missing required param '{_path_str(path + (name,))}' "
                                          f"({type_name(hints[name])}){where}")
                ok = False
        if not ok:
            return _FAIL
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            label = f"param '{_path_str(path)}'" if path else f"params{where}"
            self.error(path, "value", f"invalid {label}: {exc}")
            return _FAIL

    # -- values ----------------------------------------------------------------------------
    def value(self, value: Any, tp: Any, path: tuple, lenient: bool = True) -> Any:
        if tp is Any or tp is object:
            return value
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is typing.Annotated:
            return self.value(value, args[0], path, lenient)
        if origin is typing.Union or origin is types.UnionType:
            return self.union(value, tp, args, path, lenient)
        if origin is typing.Literal:
            for a in args:
                if type(a) is type(value) and a == value:
                    return value
            if isinstance(value, bool) and ("on" if value else "off") in args:
                return "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
            hint = did_you_mean(value, [a for a in args if isinstance(a, str)]) \
                if isinstance(value, str) else ""
            allowed = ", ".join(repr(a) for a in args)
            self.error(path, "value", f"param '{_path_str(path)}' must be one of {allowed}, "
                                      f"got {_show(value)}{hint}")
            return _FAIL
        if tp is type(None) or tp is None:
            return value if value is None else self.mismatch(path, tp, value)
        containers = (list, tuple, set, frozenset, dict)
        if origin in containers or tp in containers:
            return self.container(value, tp, origin or tp, args, path, lenient)
        if origin in (abc.Sequence, abc.MutableSequence, abc.Iterable):
            return self.container(value, tp, list, args, path, lenient)
        if origin in (abc.Mapping, abc.MutableMapping):
            return self.container(value, tp, dict, args, path, lenient)
        if tp is bool:
            return value if isinstance(value, bool) else self.mismatch(path, tp, value)
        if tp is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            return value if ok else self.mismatch(path, tp, value)
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if lenient and isinstance(value, str):
                try:
                    return float(value.strip())
                except ValueError:
                    pass
            return self.mismatch(path, tp, value)
        if tp is str:
            return value if isinstance(value, str) else self.mismatch(path, tp, value)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                return value
            return self.dataclass(tp, value, path)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            for member in tp:
                if value == member.value or value == member.name:
                    return member
            return self.mismatch(path, tp, value, f" (one of {', '.join(m.name for m in tp)})")
        if isinstance(tp, type) and issubclass(tp, pathlib.PurePath):
            return tp(value) if isinstance(value, (str, tp)) else self.mismatch(path, tp, value)
        if isinstance(tp, type):
            return value if isinstance(value, tp) else self.mismatch(path, tp, value)
        return value  # a typing construct this checker does not know: accept

    def union(self, value: Any, tp: Any, args: tuple, path: tuple, lenient: bool) -> Any:
        non_none = [a for a in args if a is not type(None)]
        if value is None and len(non_none) < len(args):
            return None
        if len(non_none) == 1:  # Optional[X]: X's own message is the most precise
            return self.value(value, non_none[0], path, lenient)
        for attempt_lenient in ((False, True) if lenient else (False,)):
            for a in non_none:
                trial = _Checker(self.mark_of, self.owner)
                result = trial.value(value, a, path, attempt_lenient)
                if result is not _FAIL:
                    return result
        return self.mismatch(path, tp, value)

    def container(self, value: Any, tp: Any, origin: Any, args: tuple, path: tuple,
                  lenient: bool) -> Any:
        if origin is dict:
            if not isinstance(value, dict):
                return self.mismatch(path, tp, value)
            ktp, vtp = (args + (Any, Any))[:2] if args else (Any, Any)
            out, ok = {}, True
            for k, v in value.items():
                ck = self.value(k, ktp, path + (k,), lenient)
                cv = self.value(v, vtp, path + (k,), lenient)
                if ck is _FAIL or cv is _FAIL:
                    ok = False
                else:
                    out[ck] = cv
            return out if ok else _FAIL
        if not isinstance(value, (list, tuple)):
            return self.mismatch(path, tp, value)
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if args == ((),):
                args = ()
            if len(value) != len(args):
                return self.mismatch(path, tp, value,
                                     f" ({len(value)} items, expected {len(args)})")
            item_types = list(args)
        else:
            item_types = [args[0] if args else Any] * len(value)
        out_items, ok = [], True
        for i, (item, itp) in enumerate(zip(value, item_types)):
            c = self.value(item, itp, path + (i,), lenient)
            if c is _FAIL:
                ok = False
            else:
                out_items.append(c)
        if not ok:
            return _FAIL
        if origin in (set, frozenset):
            try:
                return origin(out_items)
            except TypeError:
                return self.mismatch(path, tp, value)
        return tuple(out_items) if origin is tuple else out_items


def validate_params(config_cls: type, params: Any, mark_of: MarkOf | None = None,
                    owner: str = "") -> tuple[Any | None, list[tuple[Any, str]]]:
    """Build ``config_cls(**params)`` after checking every param; return ``(instance, errors)``.

    ``errors`` is a list of ``(mark_of(path, where), message)``; when it is non-empty the
    instance is ``None``. ``where`` is ``"key"`` for an unknown param (points at its name) and
    ``"value"`` otherwise; missing fields and ``__post_init__`` failures (``ValueError`` or
    ``TypeError``) are reported at the enclosing mapping (``path == ()`` for the params).
    ``owner`` (``train:dflash``) is put in messages. Without ``mark_of`` marks are dotted paths.
    """
    checker = _Checker(mark_of, owner)
    instance = checker.dataclass(config_cls, params, ())
    if checker.errors or instance is _FAIL:
        return None, checker.errors
    return instance, []


def plain(value: Any) -> Any:
    """JSON-like form of a converted param (dataclass -> dict, tuple/set -> list, enum -> value)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return value
