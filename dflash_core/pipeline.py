"""The validated pipeline: what the loader produces and the runner, ``graph`` and ``status`` read.

Nothing here parses YAML; see :mod:`dflash_core.pipeline_file` for that. Keeping the model
separate lets tests and plugins build pipelines in code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from dflash_core.stage import Stage
from dflash_core.vocabulary import Executor, Link


@dataclass(frozen=True)
class Mark:
    """Where a YAML node starts (1-based line and column), for ``file:line:col`` messages."""

    file: str
    line: int
    col: int


@dataclass(frozen=True)
class Problem:
    """A mistake between stages that :meth:`Stage.check` found: reported at stage ``stage``'s
    key ``at`` in the pipeline file (``("params", "every_steps")``; ``()``: the stage's name)."""

    stage: str
    message: str
    at: tuple[str, ...] = ()


@dataclass
class StageSpec:
    """One entry of ``stages:`` after validation."""

    name: str
    """Key in ``stages:`` (also the default kind when ``uses`` is a bare name)."""
    uses: str
    cls: type[Stage]
    config: Any
    """Instance of ``cls.Config`` built from ``params``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Params given in the file (after ``--set``), normalised to the Config's types."""
    after: dict[str, str] = field(default_factory=dict)
    """Input port -> upstream stage name."""
    device: str = "cpu"
    """Resolved torch device string (``cpu``, ``cuda:0``)."""
    link: Link | None = None
    """Link of this stage's input edges if the file set one; else each upstream's default."""
    executor: Executor = Executor.THREAD
    ranks: tuple[int, ...] | None = None
    """torchrun ranks that run this stage (None = every rank). A stream link between stages on
    different ranks crosses processes (``dflash_core/remote.py``): N producer ranks fan in to M
    consumer ranks, N a multiple of M."""
    mark: Mark | None = None

    @property
    def impl(self) -> str:
        return f"{self.cls.kind}:{self.cls.name}"


@dataclass
class Pipeline:
    """A validated pipeline file."""

    path: str
    run_dir: str
    stages: dict[str, StageSpec]
    version: int = 1
    devices_checked: bool = False
    """Whether the stages' devices were checked against this host (``run``); ``validate``,
    ``plan`` and ``graph`` read a file away from its GPUs, so a check of a device's kind skips."""

    def graph(self) -> nx.DiGraph:
        """Stage DAG; each edge carries ``port`` and ``link``."""
        g = nx.DiGraph()
        for name in self.stages:
            g.add_node(name)
        for name, spec in self.stages.items():
            for port, upstream in spec.after.items():
                g.add_edge(upstream, name, port=port, link=self.link(upstream, name))
        return g

    def link(self, upstream: str, downstream: str) -> Link:
        """``stream`` or ``materialize`` for the edge upstream -> downstream."""
        spec = self.stages[downstream]
        return Link(spec.link or self.stages[upstream].cls.default_link)

    def order(self) -> list[str]:
        """Stages in a topological order that keeps file order where the DAG allows."""
        position = {name: i for i, name in enumerate(self.stages)}
        return list(nx.lexicographical_topological_sort(self.graph(), key=position.__getitem__))

    def downstream(self, name: str) -> list[str]:
        return sorted(nx.descendants(self.graph(), name), key=self.order().index)

    def consumers(self, name: str) -> list[str]:
        return [d for d in self.order() if name in self.stages[d].after.values()]

    # what crosses stages: the engine wires it (StageContext) and Stage.check reads it here
    def fan_in(self, name: str) -> dict[str, int]:
        """Input port -> producer ranks feeding each rank of ``name`` (N/M of an N -> M fan-in;
        1 when both run on the same ranks)."""
        spec = self.stages[name]
        out = {}
        for port, upstream in spec.after.items():
            producers = self.stages[upstream].ranks
            same = not producers or not spec.ranks or producers == spec.ranks
            out[port] = 1 if same else len(producers) // len(spec.ranks)
        return out

    def upstream_facts(self, name: str) -> dict[str, Any]:
        """The facts that reach ``name``: what each upstream stage publishes for its consumers
        over what reached that stage in turn (the nearer publisher wins; ports in order)."""
        facts: dict[str, Any] = {}
        for upstream in self.stages[name].after.values():
            spec = self.stages[upstream]
            facts.update(self.upstream_facts(upstream))
            facts.update(spec.cls.facts_for_consumers(spec.config))
        return facts

    def consumer_facts(self, name: str) -> dict[str, dict[str, Any]]:
        """Consumer -> the facts it publishes for the stages feeding it."""
        return {c: dict(self.stages[c].cls.facts_for_producers(self.stages[c].config))
                for c in self.consumers(name)}
