"""``dflash-pipe graph PIPELINE``: the DAG as text (default) or Graphviz dot."""

from __future__ import annotations

import argparse
from typing import Any

from dflash_core.cli.common import EXIT_OK, add_pipeline_args, console, load
from dflash_core.vocabulary import Link


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("graph", parents=[common], help="show the stage DAG")
    add_pipeline_args(p)
    p.add_argument("--dot", action="store_true", help="print Graphviz dot")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _, pipeline = load(args)
    g = pipeline.graph()
    if args.dot:
        lines = ["digraph pipeline {", "  rankdir=LR;"]
        for name in pipeline.order():
            spec = pipeline.stages[name]
            lines.append(f'  "{name}" [label="{name}\\n{spec.impl}\\n{spec.device}"];')
        for u, v, data in g.edges(data=True):
            style = "solid" if data["link"] == Link.STREAM else "dashed"
            lines.append(f'  "{u}" -> "{v}" [label="{data["link"]}", style={style}];')
        lines.append("}")
        print("\n".join(lines))
        return EXIT_OK
    for name in pipeline.order():
        spec = pipeline.stages[name]
        outs = [f"{v} ({d['link']})" for _, v, d in g.out_edges(name, data=True)]
        arrow = f" -> {', '.join(outs)}" if outs else ""
        console.print(f"{name} [{spec.impl} @ {spec.device}, {spec.executor}]{arrow}")
    return EXIT_OK
