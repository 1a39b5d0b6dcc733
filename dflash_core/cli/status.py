"""``dflash-pipe status PIPELINE``: fresh / stale / missing / streamed per stage, with causes."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from dflash_core.cli.common import EXIT_OK, add_pipeline_args, console, load


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="what is fresh, stale or missing")
    add_pipeline_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_core.artifacts import ArtifactStore
    from dflash_core.cli.run import resume_command
    from dflash_core.resume import finished_at, interrupted_at, latest_checkpoint, owed_after_training
    from dflash_core.runstate import RunRecord, analyse

    _, pipeline = load(args)
    store = ArtifactStore(pipeline.run_dir)
    statuses = analyse(pipeline, store, RunRecord(pipeline.run_dir))
    table = Table(title=f"status of {pipeline.run_dir}")
    for col in ("stage", "state", "artifact", "cause"):
        table.add_column(col)
    for name in pipeline.order():
        st = statuses[name]
        table.add_row(name, st.state, st.key or "-", st.cause)
    console.print(table)
    ckpt = latest_checkpoint(pipeline.run_dir)
    done, stopped = finished_at(pipeline.run_dir), interrupted_at(pipeline.run_dir)
    owing = owed_after_training(pipeline, done)
    console.print(f"latest checkpoint: {ckpt or 'none'}"
                  + (f" (training finished at step {done})" if done is not None else "")
                  + (f" ({', '.join(owing)} had not finished; finish it with: {resume_command(args)})"
                     if owing else "")
                  + (f" (the run was interrupted at step {stopped}; continue it with: "
                     f"{resume_command(args)})" if stopped is not None else ""),
                  soft_wrap=True)
    return EXIT_OK
