"""``dflash-pipe validate PIPELINE``: check the file and its plugins; start nothing."""

from __future__ import annotations

import argparse
from typing import Any

from dflash_core.cli.common import EXIT_OK, add_pipeline_args, console, load


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("validate", parents=[common], help="check a pipeline file")
    add_pipeline_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _, pipeline = load(args)
    console.print(f"{args.pipeline}: ok — {len(pipeline.stages)} stages, run dir {pipeline.run_dir}")
    for name in pipeline.order():
        spec = pipeline.stages[name]
        ups = ", ".join(f"{port}<-{u} ({pipeline.link(u, name)})" for port, u in spec.after.items())
        ranks = f" ranks {','.join(map(str, spec.ranks))}" if spec.ranks else ""
        console.print(f"  {name}: {spec.impl} on {spec.device} [{spec.executor}]{ranks}"
                      f"{'  ' + ups if ups else ''}")
    return EXIT_OK
