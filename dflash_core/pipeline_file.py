"""Read a pipeline file (plus ``--set`` overrides) into a validated :class:`Pipeline`.

Every problem is collected, each at the ``file:line:col`` of the offending key or value, and
raised together as one :class:`~dflash_core.errors.PipelineFileError` before anything runs.

The file is read with ``yaml.safe_load`` semantics, but composed into a node tree first so
that positions survive: ``Node`` keeps each value with the mark of its key and of itself.

File format (version 1)::

    version: 1                      # required, must be 1
    run_dir: ../runs/my_run         # optional; default runs/<pipeline file stem>. A relative
                                    # path here and in a stage's path params is relative to
                                    # the pipeline file's directory (dflash_core/paths.py);
                                    # fsspec URLs (s3://…) are kept as is
    defaults: {device: cpu, executor: thread}   # optional, applied to every stage
    storage_options: {endpoint_url: …}          # optional: every stage with a storage_options
                                                # param (download, checkpoint) gets it unless
                                                # the stage sets its own
    x-anything: &anchor {...}       # keys starting with x- are ignored (for YAML anchors)
    stages:                         # non-empty mapping, in run order where the DAG allows
      NAME: {uses, after, device, link, executor, ranks, params}

``--set PATH=VALUE`` overrides (``stages.train.params.lr=3e-4``, ``run_dir=/tmp/x``) are
applied to the tree before validation; VALUE is read with ``yaml.safe_load`` and errors in it
are reported as ``--set:N:col`` (N = 1-based index of the override).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable, Sequence

import networkx as nx

from dflash_core.config_types import did_you_mean, param_help, plain, validate_params
from dflash_core.devices import resolve_device
from dflash_core.errors import ConfigError, PipelineFileError
from dflash_core.paths import path_fields, resolve_path
from dflash_core.items import describe, misfit, port_types
from dflash_core.pipeline import Mark, Pipeline, StageSpec
from dflash_core.stage import Stage
from dflash_core.vocabulary import Executor, Link
from dflash_core.yaml_nodes import SET_FILE, ErrorList, Node, apply_override, compose, parse_override

VERSION = 1
TOP_KEYS = ("version", "run_dir", "stages", "defaults", "storage_options")
STORAGE = "storage_options"
STAGE_KEYS = ("uses", "after", "device", "link", "executor", "ranks", "params")
DEFAULT_KEYS = ("device", "executor")
EXTENSION_PREFIX = "x-"
"""Top-level keys starting with this are ignored (a place for YAML anchors, as in compose files)."""
_STAGE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
AfterEntry = tuple[str | None, str, Node]
"""One ``after:`` item: (the port it names, or None; the upstream stage; its node)."""


# -- validation ----------------------------------------------------------------------------

def _known_kinds(plugins: Any) -> list[str]:
    return plugins.registry.kinds()


def _impls(plugins: Any, kind: str | None = None) -> list[str]:
    return [f"{k}:{n}" for (k, n), _ in plugins.registry.items() if kind is None or k == kind]


def _failed_note(plugins: Any) -> str:
    failed = plugins.failed_plugins()
    if not failed:
        return ""
    parts = [f"plugin '{p.name}' ({p.module}) failed to import: {p.error}" for p in failed]
    return "; " + "; ".join(parts)


class _Loader:
    def __init__(self, path: str, plugins: Any, errors: ErrorList, check_devices: bool,
                 base_dir: str) -> None:
        self.path = path
        self.plugins = plugins
        self.errors = errors
        self.check_devices = check_devices
        self.base_dir = base_dir
        self.classes: dict[str, type[Stage] | None] = {}
        self.storage: dict[str, Any] | None = None
        """The top-level storage_options, for the stages that do not set theirs."""

    def absolute(self, node: Node) -> None:
        """Resolve a relative path in ``node`` (a string or a list of them) in place: against
        the pipeline file's directory, or the current one for a ``--set`` value."""
        base = os.getcwd() if node.mark.file == SET_FILE else self.base_dir
        for item in node.value if node.kind == "seq" else [node]:
            if item.kind == "scalar" and isinstance(item.value, str) and item.value.strip():
                item.value = resolve_path(item.value, base)

    def err(self, mark: Mark, message: str, help: str = "") -> None:
        self.errors.add(mark, message, help)

    # top level --------------------------------------------------------------------------
    def load(self, root: Node | None) -> Pipeline | None:
        start = Mark(self.path, 1, 1)
        if root is None:
            self.err(start, "empty pipeline file (expected a mapping with 'version: 1' and "
                            "'stages:')")
            return None
        if not root.is_map:
            self.err(root.mark, f"the top level must be a mapping with 'version' and 'stages', "
                                f"got {root.describe()}")
            return None
        top = root.value
        for key, node in top.items():
            if key not in TOP_KEYS and not str(key).startswith(EXTENSION_PREFIX):
                hint = did_you_mean(key, TOP_KEYS) or f" (expected one of: {', '.join(TOP_KEYS)})"
                self.err(node.at_key, f"unknown top-level key '{key}'{hint}")
        version = self.version(top.get("version"), root)
        run_dir = self.run_dir(top.get("run_dir"))
        defaults = self.defaults(top.get("defaults"))
        storage = top.get(STORAGE)
        if storage is not None and not storage.is_map:
            self.err(storage.mark, f"'{STORAGE}' must be a mapping of fsspec options, "
                                   f"got {storage.describe()}")
        elif storage is not None:
            self.storage = storage.plain()
        stages_node = top.get("stages")
        if stages_node is None:
            self.err(root.mark, "missing 'stages:' (a mapping of stage name -> settings)")
            return None
        if not stages_node.is_map or not stages_node.value:
            what = "empty" if stages_node.is_map or stages_node.value is None \
                else stages_node.describe()
            self.err(stages_node.mark if stages_node.value is not None else stages_node.at_key,
                     f"'stages' must be a non-empty mapping of stage name -> settings, got {what}")
            return None
        stage_nodes: dict[str, Node] = {}
        for name, node in stages_node.value.items():
            if not isinstance(name, str) or not _STAGE_NAME_RE.match(name):
                self.err(node.at_key, f"bad stage name {name!r} (use letters, digits, '_' or '-', "
                                      "starting with a letter or '_')")
                continue
            stage_nodes[name] = node
        # classes first: binding ports of a stage looks at its upstreams' kinds
        for name, node in stage_nodes.items():
            self.classes[name] = self.resolve_class(name, node)
        specs = {}
        for name, node in stage_nodes.items():
            spec = self.stage(name, node, stage_nodes, defaults)
            if spec is not None:
                specs[name] = spec
        self.cycles(stage_nodes)
        self.cross_rank_links(specs, stage_nodes)
        if self.errors or version is None:
            return None
        pipeline = Pipeline(self.path, run_dir, specs, version, devices_checked=self.check_devices)
        self.port_types(pipeline, stage_nodes)
        self.stage_checks(pipeline, stage_nodes)
        return None if self.errors else pipeline

    def version(self, node: Node | None, root: Node) -> int | None:
        if node is None:
            self.err(root.mark, f"missing 'version: {VERSION}'")
            return None
        v = node.value
        if node.kind != "scalar" or isinstance(v, bool) or not isinstance(v, int) or v != VERSION:
            self.err(node.mark, f"unsupported pipeline file version {node.describe()} "
                                f"(this dflash-pipe reads version {VERSION})")
            return None
        return v

    def run_dir(self, node: Node | None) -> str:
        stem = os.path.splitext(os.path.basename(self.path))[0]
        stem = re.sub(r"[^A-Za-z0-9_.\-]", "", stem) or "pipeline"  # "<pipeline>" -> "pipeline"
        default = os.path.join(self.base_dir, "runs", stem)
        if node is None:
            return default
        if node.kind != "scalar" or not isinstance(node.value, str) or not node.value.strip():
            self.err(node.mark, f"'run_dir' must be a non-empty string (a path or URL), "
                                f"got {node.describe()}")
            return default
        self.absolute(node)
        return node.value

    def defaults(self, node: Node | None) -> dict[str, Node]:
        if node is None or (node.kind == "scalar" and node.value is None):
            return {}
        if not node.is_map:
            self.err(node.mark, f"'defaults' must be a mapping (device, executor), "
                                f"got {node.describe()}")
            return {}
        out = {}
        for key, value in node.value.items():
            if key not in DEFAULT_KEYS:
                hint = did_you_mean(key, DEFAULT_KEYS) or \
                    f" (expected one of: {', '.join(DEFAULT_KEYS)})"
                self.err(value.at_key, f"unknown key '{key}' in 'defaults'{hint}")
                continue
            out[key] = value
        if "executor" in out and self.choice(out["executor"], "executor", Executor.values()) is None:
            del out["executor"]
        if "device" in out:
            device = self.device(out["device"])
            if device is None:
                del out["device"]
            else:
                out["device"] = Node(device, out["device"].mark)
        return out

    # one stage ---------------------------------------------------------------------------
    def resolve_class(self, name: str, node: Node) -> type[Stage] | None:
        if node.kind == "scalar" and node.value is None:
            node.kind, node.value = "map", {}
        if not node.is_map:
            self.err(node.mark, f"stage '{name}' must be a mapping (uses, after, device, link, "
                                f"executor, params), got {node.describe()}")
            return None
        uses_node = node.value.get("uses")
        registry = self.plugins.registry
        failed = _failed_note(self.plugins)
        if uses_node is None:
            impls = _impls(self.plugins, name)
            if len(impls) == 1:
                kind, impl = impls[0].split(":", 1)
                return registry.get(kind, impl)
            if not impls:
                self.err(node.at_key, f"stage '{name}' has no 'uses' and there is no stage kind "
                                      f"'{name}'{did_you_mean(name, _known_kinds(self.plugins))}; "
                                      f"available: {', '.join(_impls(self.plugins)) or 'none'}"
                                      f"{failed}")
            else:
                self.err(node.at_key, f"stage kind '{name}' has several implementations; "
                                      f"choose one with 'uses:': {', '.join(impls)}")
            return None
        uses = uses_node.value
        if uses_node.kind != "scalar" or not isinstance(uses, str) or not uses.strip():
            self.err(uses_node.mark, f"'uses' must be a string (kind:name or name), "
                                     f"got {uses_node.describe()}")
            return None
        uses = uses.strip()
        matches = registry.resolve(uses, kind_hint=name)
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            choices = ", ".join(sorted(f"{c.kind}:{c.name}" for c in matches))
            self.err(uses_node.mark, f"ambiguous stage implementation '{uses}': "
                                     f"write one of {choices}")
            return None
        kind, _, impl = uses.rpartition(":")
        kind = kind or name
        if kind in _known_kinds(self.plugins):
            available = _impls(self.plugins, kind)
            label = f"available for kind '{kind}'"
        else:
            available = _impls(self.plugins)
            label = "available"
        names = available + [a.split(":", 1)[1] for a in available]
        hint = did_you_mean(uses, names)
        self.err(uses_node.mark, f"unknown stage implementation '{uses}'{hint}; "
                                 f"{label}: {', '.join(available) or 'none'}{failed}")
        return None

    def stage(self, name: str, node: Node, stage_nodes: dict[str, Node],
              defaults: dict[str, Node]) -> StageSpec | None:
        if not node.is_map:
            return None
        body = node.value
        for key, value in body.items():
            if key not in STAGE_KEYS:
                hint = did_you_mean(key, STAGE_KEYS) or \
                    f" (expected one of: {', '.join(STAGE_KEYS)})"
                self.err(value.at_key, f"unknown key '{key}' in stage '{name}'{hint}")
        cls = self.classes.get(name)
        after = self.after(name, node, body.get("after"), cls, stage_nodes)
        link = self.choice(body["link"], "link", Link.values()) if "link" in body else None
        if link is not None and cls is not None and not cls.inputs:
            self.err(body["link"].at_key, f"'link' sets how a stage's inputs arrive, and '{name}' "
                                          f"({cls.kind}:{cls.name}) is a source stage; set it on "
                                          "the consumers")
            link = None
        executor_node = body.get("executor", defaults.get("executor"))
        executor = (self.choice(executor_node, "executor", Executor.values())
                    if executor_node is not None else None)
        if "device" in body:
            device = self.device(body["device"])
        else:
            device = defaults["device"].value if "device" in defaults else "cpu"
        config, params = None, {}
        if cls is not None:
            config, params = self.params(name, node, body.get("params"), cls)
        if cls is None or config is None or after is None or device is None:
            return None
        if ("link" in body and link is None) or (executor_node is not None and executor is None):
            return None
        ranks = self.ranks(body["ranks"]) if "ranks" in body else None
        if "ranks" in body and ranks is None:
            return None
        uses = body["uses"].value.strip() if "uses" in body else name
        return StageSpec(name=name, uses=uses, cls=cls, config=config, params=params, after=after,
                         device=device, link=Link(link) if link else None,
                         executor=Executor(executor or cls.default_executor),
                         ranks=ranks, mark=node.at_key)

    def ranks(self, node: Node) -> tuple[int, ...] | None:
        """``ranks: [0, 1, 2]``, ``ranks: 3`` or ``ranks: "0-2"`` -> sorted unique rank ids."""
        v = node.value
        out: list[int] = []
        if node.kind == "scalar" and isinstance(v, int) and not isinstance(v, bool):
            out = [v]
        elif node.kind == "scalar" and isinstance(v, str) and re.fullmatch(r"\s*\d+\s*-\s*\d+\s*", v):
            lo, hi = (int(x) for x in v.split("-"))
            out = list(range(lo, hi + 1))
        elif node.kind == "seq" and all(i.kind == "scalar" and isinstance(i.value, int)
                                        and not isinstance(i.value, bool) for i in node.value):
            out = [i.value for i in node.value]
        if not out or any(r < 0 for r in out) or len(set(out)) != len(out):
            self.err(node.mark, f"'ranks' must be torchrun ranks: a list of distinct integers >= 0, "
                                f"one integer, or a range like \"0-2\"; got {node.describe()}")
            return None
        return tuple(sorted(out))

    def cross_rank_links(self, specs: dict[str, StageSpec], nodes: dict[str, Node]) -> None:
        """A link between stages placed on different ranks must stream, from disjoint rank sets,
        N producers to M consumers with N a multiple of M (each consumer reads N/M producers)."""
        for name, spec in specs.items():
            for upstream in spec.after.values():
                up = specs.get(upstream)
                if up is None or up.ranks == spec.ranks:
                    continue
                mark = nodes[name].value.get("ranks", nodes[name]).mark
                if up.ranks is None or spec.ranks is None:
                    self.err(mark, f"stages '{upstream}' and '{name}' are linked, so give both 'ranks' "
                                   f"(only one has them)")
                    continue
                link = spec.link or up.cls.default_link
                if link != "stream":
                    self.err(mark, f"'{upstream}' -> '{name}' crosses ranks and must stream "
                                   f"(link: stream), not {link}")
                elif set(up.ranks) & set(spec.ranks):
                    self.err(mark, f"'{upstream}' (ranks {list(up.ranks)}) and '{name}' (ranks "
                                   f"{list(spec.ranks)}) share some ranks: use the same ranks or disjoint ones")
                elif len(up.ranks) % len(spec.ranks):
                    self.err(mark, f"'{upstream}' on {len(up.ranks)} ranks cannot feed '{name}' on "
                                   f"{len(spec.ranks)} evenly: the producer count must be a multiple "
                                   f"of the consumer count")

    def choice(self, node: Node, key: str, allowed: Sequence[str]) -> str | None:
        if node.kind == "scalar" and isinstance(node.value, str) and node.value in allowed:
            return node.value
        shown = f"'{node.value}'" if isinstance(node.value, str) else node.describe()
        hint = did_you_mean(node.value, allowed) if isinstance(node.value, str) else ""
        self.err(node.mark, f"'{key}' must be one of {', '.join(allowed)}, got {shown}{hint}")
        return None

    def device(self, node: Node) -> str | None:
        if node.kind != "scalar" or not isinstance(node.value, str):
            self.err(node.mark, f"'device' must be a string (cpu, cuda, cuda:N, mps), "
                                f"got {node.describe()}")
            return None
        try:
            return resolve_device(node.value, self.plugins.hook, self.check_devices)
        except ValueError as exc:
            self.err(node.mark, str(exc))
            return None

    def after(self, name: str, node: Node, after: Node | None, cls: type[Stage] | None,
              stage_nodes: dict[str, Node]) -> dict[str, str] | None:
        """Input port -> upstream stage, or None after reporting errors. Three phases: read the
        ``after:`` node into entries, check each entry's upstream stage, bind entries to ports."""
        read = self.after_entries(after)
        if read is None:
            return None
        entries, ok = read
        ok = self.check_upstreams(name, entries, stage_nodes) and ok
        if cls is None:
            return None
        if not cls.inputs:
            if entries:
                self.err(after.at_key, f"stage '{name}' ({cls.kind}:{cls.name}) is a source stage and "
                                       "takes no 'after'")
                return None
            return {} if ok else None
        if not ok:
            return None
        bound = self.bind_ports(name, cls, entries)
        if bound is None or self.report_unbound_ports(name, node, after, cls, bound):
            return None
        return {p: bound[p] for p in cls.inputs}

    def after_entries(self, after: Node | None) -> tuple[list[AfterEntry], bool] | None:
        """The entries of ``after:`` (a name, a list of names or a mapping port -> name) and
        whether every item was a name; None when the node has none of those shapes."""
        entries: list[AfterEntry] = []
        ok = True
        if after is None or (after.kind == "scalar" and after.value is None):
            pass
        elif after.kind == "scalar" and isinstance(after.value, str):
            entries.append((None, after.value, after))
        elif after.kind == "seq":
            for item in after.value:
                if item.kind == "scalar" and isinstance(item.value, str):
                    entries.append((None, item.value, item))
                else:
                    self.err(item.mark, f"'after' items must be stage names, got {item.describe()}")
                    ok = False
        elif after.is_map:
            for port, item in after.value.items():
                if item.kind == "scalar" and isinstance(item.value, str):
                    entries.append((str(port), item.value, item))
                else:
                    self.err(item.mark, f"'after' maps input port -> stage name, "
                                        f"got {item.describe()} for port '{port}'")
                    ok = False
        else:
            self.err(after.mark, f"'after' must be a stage name, a list of names or a mapping "
                                 f"port -> name, got {after.describe()}")
            return None
        return entries, ok

    def check_upstreams(self, name: str, entries: list[AfterEntry], stage_nodes: dict[str, Node]) -> bool:
        """Each upstream is another stage of the file, listed once (unless under two ports)."""
        ok = True
        seen: set[str] = set()
        for port, upstream, item in entries:
            if upstream == name:
                self.err(item.mark, f"stage '{name}' lists itself in 'after' (a stage cannot "
                                    "consume its own output)")
                ok = False
            elif upstream not in stage_nodes:
                others = [s for s in stage_nodes if s != name]
                hint = did_you_mean(upstream, others) or f" (stages: {', '.join(others)})"
                self.err(item.mark, f"missing upstream: no stage '{upstream}'{hint}")
                ok = False
            elif upstream in seen and port is None:
                self.err(item.mark, f"stage '{upstream}' is listed twice in 'after'")
                ok = False
            seen.add(upstream)
        return ok

    def bind_ports(self, name: str, cls: type[Stage], entries: list[AfterEntry]) -> dict[str, str] | None:
        """Port -> upstream: an explicit port first, else a port named like the upstream stage or
        its kind, else the only free port; None after reporting an entry that fits no port."""
        ports = list(cls.inputs)
        impl = f"{cls.kind}:{cls.name}"
        ok = True
        bound: dict[str, str] = {}
        pending: list[tuple[str, Node]] = []
        for port, upstream, item in entries:
            if port is None:
                pending.append((upstream, item))
                continue
            if port not in ports:
                self.err(item.at_key,
                         f"{impl} has no input port '{port}'{did_you_mean(port, ports)} "
                         f"(ports: {', '.join(ports)})")
                ok = False
                continue
            bound[port] = upstream
        still: list[tuple[str, Node]] = []
        for upstream, item in pending:  # a port named like the upstream stage or its kind
            up_cls = self.classes.get(upstream)
            candidates = [upstream] + ([up_cls.kind] if up_cls is not None else [])
            port = next((p for p in candidates if p in ports and p not in bound), None)
            if port is None:
                still.append((upstream, item))
            else:
                bound[port] = upstream
        for upstream, item in still:
            free = [p for p in ports if p not in bound]
            if len(free) == 1:
                bound[free[0]] = upstream
            elif not free:
                self.err(item.mark, f"stage '{upstream}' has no free input port of '{name}' "
                                    f"({impl} ports: {', '.join(ports)}, all bound)")
                ok = False
            else:
                self.err(item.mark, f"cannot tell which input port of '{name}' ({impl}) "
                                    f"'{upstream}' feeds: write after: {{PORT: {upstream}}} "
                                    f"with PORT one of {', '.join(free)}")
                ok = False
        return bound if ok else None

    def report_unbound_ports(self, name: str, node: Node, after: Node | None, cls: type[Stage],
                             bound: dict[str, str]) -> bool:
        """Report each input port no upstream feeds; True when there was one."""
        ports = list(cls.inputs)
        impl = f"{cls.kind}:{cls.name}"
        missing = [p for p in ports if p not in bound]
        if not missing:
            return False
        mark = after.at_key if after is not None else node.at_key
        # a source stage whose author left out ``inputs = ()`` has Stage's port: say so
        inherited = not any("inputs" in vars(c) for c in cls.__mro__ if c is not Stage)
        source = (f"; or, if {impl} reads no upstream, declare inputs = () in its class, "
                  f"which now inherits Stage's port '{ports[0]}'" if inherited else "")
        for port in missing:
            self.err(mark, f"stage '{name}' ({impl}) needs an upstream for port '{port}' "
                           f"(add after: {{{port}: STAGE}})" if len(ports) > 1 else
                     f"stage '{name}' ({impl}) needs an upstream for port '{port}' "
                     f"(add 'after: STAGE'{source})")
        return True

    def params(self, name: str, node: Node, params: Node | None,
               cls: type[Stage]) -> tuple[Any, dict[str, Any]]:
        impl = f"{cls.kind}:{cls.name}"
        # whole-mapping problems (missing field, __post_init__) point at the ``params:`` key,
        # or at the stage's key when it has no params
        home = params.at_key if params is not None else node.at_key
        paths: dict[Mark, tuple] = {}  # mark -> its param: an error there shows the param's help

        def mark_of(path: tuple, where: str) -> Mark:
            cur, mark = params, home
            for key in path:
                if cur is None or cur.kind == "scalar":
                    break
                if cur.is_map:
                    nxt = cur.value.get(key)
                else:
                    nxt = cur.value[key] if isinstance(key, int) and key < len(cur.value) else None
                if nxt is None:
                    break
                cur, mark = nxt, (nxt.at_key if where == "key" or nxt.is_map else nxt.mark)
            paths[mark] = path if where == "value" else ()
            return mark

        if params is not None and params.is_map:
            for key in path_fields(cls.Config):
                if key in params.value:
                    self.absolute(params.value[key])
        raw = params.plain() if params is not None else {}
        if (self.storage is not None and isinstance(raw, dict) and STORAGE not in raw
                and dataclasses.is_dataclass(cls.Config)
                and any(f.name == STORAGE for f in dataclasses.fields(cls.Config))):
            raw[STORAGE] = self.storage
        config, errors = validate_params(cls.Config, raw, mark_of, owner=impl)
        for mark, message in errors:
            self.err(mark, message, param_help(cls.Config, paths.get(mark, ())))
        if config is None:
            return None, {}
        given = raw if isinstance(raw, dict) else {}
        return config, {k: plain(getattr(config, k)) for k in given if hasattr(config, k)}

    # what crosses stages --------------------------------------------------------------------
    def port_types(self, pipeline: Pipeline, nodes: dict[str, Node]) -> None:
        """Each link's producer yields items its consumer's port takes; else an error at the
        ``after:`` entry, naming both stages and both types."""
        for name, spec in pipeline.stages.items():
            ports = port_types(spec.cls)
            for port, upstream in spec.after.items():
                up = pipeline.stages[upstream]
                why = misfit(up.cls.output, ports.get(port))
                if why and up.cls.output is not None:
                    self.err(_after_mark(nodes[name], port, upstream),
                             f"'{upstream}' ({up.impl}) yields {up.cls.output.name}s, but port '{port}' of "
                             f"'{name}' ({spec.impl}) takes {describe(ports[port])}: {why}")

    def stage_checks(self, pipeline: Pipeline, nodes: dict[str, Node]) -> None:
        """Each stage's own check of its neighbours (``Stage.check``), at the key it names."""
        for name, spec in pipeline.stages.items():
            for problem in spec.cls.check(pipeline, name):
                node = nodes.get(problem.stage, nodes[name])
                self.err(_key_mark(node, problem.at), problem.message)

    # cycles ------------------------------------------------------------------------------
    def cycles(self, stage_nodes: dict[str, Node]) -> None:
        g = nx.DiGraph()
        refs: dict[tuple[str, str], Node] = {}
        for name, node in stage_nodes.items():
            g.add_node(name)
            after = node.value.get("after") if node.is_map else None
            if after is None:
                continue
            items = ([after] if after.kind == "scalar" else
                     after.value if after.kind == "seq" else list(after.value.values()))
            for item in items:
                up = item.value
                if isinstance(up, str) and up in stage_nodes and up != name:
                    g.add_edge(up, name)
                    refs.setdefault((up, name), item)
        position = {n: i for i, n in enumerate(stage_nodes)}
        for cycle in sorted(nx.simple_cycles(g), key=lambda c: sorted(position[n] for n in c)):
            first = min(cycle, key=position.__getitem__)
            i = cycle.index(first)
            cycle = cycle[i:] + cycle[:i]  # cycle[k] -> cycle[k+1]; `first` consumes cycle[-1]
            path = " -> ".join(cycle + [first])
            self.err(refs[(cycle[-1], first)].mark, f"cycle in 'after': {path}")


def _after_mark(node: Node, port: str, upstream: str) -> Mark:
    """Where a stage's ``after:`` names ``upstream`` (for ``port``)."""
    after = node.value.get("after")
    if after is None:
        return node.at_key
    if after.is_map:
        item = after.value.get(port)
        return item.mark if item is not None else after.at_key
    if after.kind == "seq":
        return next((i.mark for i in after.value if i.value == upstream), after.mark)
    return after.mark


def _key_mark(node: Node, path: tuple[str, ...]) -> Mark:
    """The deepest key of ``path`` (``("params", "every_steps")``) a stage's node has."""
    mark = node.at_key
    for key in path:
        if not node.is_map or key not in node.value:
            break
        node = node.value[key]
        mark = node.at_key
    return mark


# -- entry points --------------------------------------------------------------------------

def load_pipeline(path: str | os.PathLike[str], plugins: Any,
                  overrides: Iterable[str] = (), check_devices: bool = True) -> Pipeline:
    """Read, override and validate a pipeline file; raise ``PipelineFileError`` with every
    problem found. ``plugins`` is a :class:`~dflash_core.plugins.PluginManager`.
    ``check_devices=False`` checks how devices are written but not that this host has them."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PipelineFileError([ConfigError(path, 1, 1, f"cannot read pipeline file: {reason}")])
    return load_pipeline_text(text, plugins, overrides, path=path, check_devices=check_devices,
                              base_dir=os.path.dirname(os.path.abspath(path)))


def load_pipeline_text(text: str, plugins: Any, overrides: Iterable[str] = (),
                       path: str = "<pipeline>", check_devices: bool = True,
                       base_dir: str | None = None) -> Pipeline:
    """Like :func:`load_pipeline` for text already read (``path`` is used in messages and for
    the default ``run_dir``; relative paths resolve against ``base_dir``, default the current
    directory)."""
    errors = ErrorList()
    errors.sources[path] = text.splitlines()
    overrides = list(overrides)
    errors.sources[SET_FILE] = overrides

    def make_mark(m: Any) -> Mark:
        return Mark(path, m.line + 1, m.column + 1)

    ok, root = compose(text, make_mark, Mark(path, 1, 1), errors)
    parsed = [parse_override(i, text_, errors) for i, text_ in enumerate(overrides, start=1)]
    if not ok:
        errors.raise_if_any()
    if root is not None and root.is_map:
        for ov in parsed:
            if ov is not None:
                apply_override(root, ov, errors, TOP_KEYS)
    pipeline = _Loader(path, plugins, errors, check_devices, base_dir or os.getcwd()).load(root)
    errors.raise_if_any()
    assert pipeline is not None
    return pipeline
