"""YAML with positions: the node tree the pipeline loader validates, and ``--set`` overrides.

PyYAML's safe loader forgets where values came from; composing the document into ``Node``s
keeps the mark of every key and value, so each error can point at ``file:line:col``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from dflash_core.config_types import did_you_mean
from dflash_core.errors import ConfigError, PipelineFileError
from dflash_core.pipeline import Mark

SET_FILE = "--set"
MAP_TAG, SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


# -- node tree with marks ------------------------------------------------------------------

@dataclass
class Node:
    """A YAML value with its position. ``value`` is a dict of ``Node`` (mapping), a list of
    ``Node`` (sequence) or a plain scalar."""

    value: Any
    mark: Mark
    kind: str = "scalar"  # scalar | map | seq
    key_mark: Mark | None = None
    """Mark of this value's key in its parent mapping (None for the root and list items)."""

    @property
    def is_map(self) -> bool:
        return self.kind == "map"

    @property
    def at_key(self) -> Mark:
        return self.key_mark or self.mark

    def plain(self) -> Any:
        if self.kind == "map":
            return {k: v.plain() for k, v in self.value.items()}
        if self.kind == "seq":
            return [v.plain() for v in self.value]
        return self.value

    def describe(self) -> str:
        if self.kind == "map":
            return "a mapping"
        if self.kind == "seq":
            return "a list"
        if self.value is None:
            return "null"
        return f"{type(self.value).__name__} {self.value!r}"


class ErrorList:
    """Collects errors with the source line of each mark."""

    def __init__(self) -> None:
        self.sources: dict[str, list[str]] = {}
        self.items: list[ConfigError] = []

    def add(self, mark: Mark, message: str, help: str = "") -> None:
        lines = self.sources.get(mark.file, [])
        src = lines[mark.line - 1] if 0 < mark.line <= len(lines) else ""
        err = ConfigError(mark.file, mark.line, mark.col, message, src, help)
        if err not in self.items:
            self.items.append(err)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            order = {f: i for i, f in enumerate(self.sources)}
            errors = sorted(self.items,
                            key=lambda e: (order.get(e.file, len(order)), e.line, e.col))
            raise PipelineFileError(errors)


class Builder:
    """Turns a composed YAML node into ``Node``s, constructing scalars like ``safe_load``."""

    def __init__(self, make_mark: Callable[[Any], Mark], errors: ErrorList) -> None:
        self.make_mark = make_mark
        self.errors = errors
        self.constructor = yaml.SafeLoader("")  # a SafeConstructor with resolver state

    def build(self, node: yaml.Node, depth: int = 0) -> Node:
        mark = self.make_mark(node.start_mark)
        if depth > 100:
            self.errors.add(mark, "YAML nesting too deep (recursive alias?)")
            return Node(None, mark)
        if not isinstance(node, yaml.ScalarNode) and node.tag not in (MAP_TAG, SEQ_TAG):
            self.errors.add(mark, f"unsupported YAML tag '{node.tag}'")  # then read it untagged
        if isinstance(node, yaml.MappingNode):
            n_explicit = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
            try:
                self.constructor.flatten_mapping(node)  # << merge keys, as safe_load does
            except yaml.MarkedYAMLError as exc:
                self.errors.add(mark, f"invalid YAML merge: {exc.problem}")
            n_merged = len(node.value) - n_explicit  # merged pairs come first; later ones win
            out: dict[Any, Node] = {}
            merged: set[Any] = set()
            for i, (key_node, value_node) in enumerate(node.value):
                key_mark = self.make_mark(key_node.start_mark)
                if not isinstance(key_node, yaml.ScalarNode):
                    self.errors.add(key_mark, "mapping keys must be plain scalars")
                    continue
                key = self.scalar(key_node)
                try:
                    hash(key)
                except TypeError:
                    self.errors.add(key_mark, f"unhashable mapping key {key!r}")
                    continue
                if key in out and i >= n_merged and key not in merged:
                    first = out[key].at_key
                    self.errors.add(key_mark, f"duplicate key '{key}' (first at line {first.line})")
                    continue
                if i < n_merged:
                    merged.add(key)
                else:
                    merged.discard(key)
                child = self.build(value_node, depth + 1)
                child.key_mark = key_mark
                out[key] = child
            return Node(out, mark, "map")
        if isinstance(node, yaml.SequenceNode):
            return Node([self.build(n, depth + 1) for n in node.value], mark, "seq")
        return Node(self.scalar(node), mark)

    def scalar(self, node: yaml.Node) -> Any:
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as exc:
            self.errors.add(self.make_mark(node.start_mark), f"invalid YAML value: {exc.problem}")
            return node.value  # the text, so that no second error follows for this value


def yaml_error(exc: yaml.YAMLError, make_mark: Callable[[Any], Mark], fallback: Mark,
                errors: ErrorList) -> None:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = make_mark(exc.problem_mark) if exc.problem_mark else fallback
        message = f"invalid YAML: {exc.problem}"
        if exc.context:
            where = ""
            if exc.context_mark is not None and exc.context_mark.line != getattr(
                    exc.problem_mark, "line", None):
                where = f" at line {exc.context_mark.line + 1}"
            message += f" ({exc.context}{where})"
    else:
        mark, message = fallback, f"invalid YAML: {exc}"
    errors.add(mark, message)


def compose(text: str, make_mark: Callable[[Any], Mark], fallback: Mark,
             errors: ErrorList) -> tuple[bool, Node | None]:
    """(ok, root) — root is None for an empty document."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        yaml_error(exc, make_mark, fallback, errors)
        return False, None
    if node is None:
        return True, None
    return True, Builder(make_mark, errors).build(node)


# -- overrides -----------------------------------------------------------------------------

@dataclass
class Override:
    index: int
    text: str
    parts: list[tuple[str, Mark]] = field(default_factory=list)
    value: Node | None = None


def parse_override(index: int, text: str, errors: ErrorList) -> Override | None:
    start = Mark(SET_FILE, index, 1)
    path, eq, rhs = text.partition("=")
    if not eq:
        errors.add(start, f"--set needs PATH=VALUE, got '{text}'")
        return None
    ov = Override(index, text)
    col = 1
    for part in path.split("."):
        if not part.strip():
            errors.add(Mark(SET_FILE, index, col), f"empty key in --set path '{path}'")
            return None
        ov.parts.append((part.strip(), Mark(SET_FILE, index, col + len(part) - len(part.lstrip()))))
        col += len(part) + 1
    offset = len(path) + 1

    def make_mark(m: Any) -> Mark:
        return Mark(SET_FILE, index, offset + 1 + (m.column if m.line == 0 else 0))

    value_start = Mark(SET_FILE, index, offset + 1)
    ok, node = compose(rhs, make_mark, value_start, errors)
    if not ok:
        return None
    ov.value = node if node is not None else Node(None, value_start)
    return ov


def apply_override(root: Node, ov: Override, errors: ErrorList, top_keys: tuple[str, ...]) -> None:
    node = root
    walked: list[str] = []
    for depth, (key, key_mark) in enumerate(ov.parts):
        last = depth == len(ov.parts) - 1
        if node.kind == "scalar" and node.value is None and walked:  # `params:` left empty
            node.kind, node.value = "map", {}
        if not node.is_map:
            where = ".".join(walked) or "the top level"
            errors.add(key_mark, f"--set path goes through '{where}', which is "
                                 f"{node.describe()}, not a mapping")
            return
        if key not in node.value:
            if depth == 0 and key not in top_keys:
                errors.add(key_mark, f"--set: unknown top-level key '{key}'"
                                     f"{did_you_mean(key, top_keys)}")
                return
            if walked == ["stages"]:
                errors.add(key_mark, f"--set: no stage '{key}'{did_you_mean(key, node.value)}")
                return
            if depth == 0 and not last and key != "defaults":
                errors.add(ov.parts[1][1], f"--set path goes through '{key}', which is not a "
                                           "mapping")
                return
            # created; validated like any key of this mapping (unknown keys are reported here)
            node.value[key] = (ov.value if last else Node({}, key_mark, "map"))
            node.value[key].key_mark = key_mark
        elif last:
            new = ov.value
            new.key_mark = node.value[key].key_mark
            node.value[key] = new
        node = node.value[key]
        walked.append(key)
