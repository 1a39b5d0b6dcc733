"""``dflash-pipe run PIPELINE``: run the DAG (or part of it) and print a summary."""

from __future__ import annotations

import argparse
import shlex
import signal
import time
from typing import TYPE_CHECKING, Any

from rich.table import Table

from dflash_core.cli.common import EXIT_OK, add_pipeline_args, console, err_console, load

if TYPE_CHECKING:
    from dflash_core.runner import Interrupted


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run a pipeline")
    add_pipeline_args(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--only", metavar="STAGE", help="run one stage from its stored inputs")
    group.add_argument("--from", dest="from_stage", metavar="STAGE",
                       help="run STAGE and everything downstream of it")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run and why; load no model, run nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue training from the latest complete checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    pm, pipeline = load(args, check_devices=True)
    return execute(args, pm, pipeline)


def execute(args: argparse.Namespace, pm: Any, pipeline: Any) -> int:
    from dflash_core.interrupts import graceful_signals
    from dflash_core.progress import make_display
    from dflash_core.resume import finished_at, owed_after_training, resume_states
    from dflash_core.runner import Interrupted, Runner

    ckpt, states = resume_states(pipeline.run_dir) if args.resume else (None, {})
    if args.resume:
        done = finished_at(pipeline.run_dir)
        owing = owed_after_training(pipeline, done)
        if done is not None and not owing:  # no data left: running again could only rewrite what is there
            console.print(f"run already complete at step {done} ({ckpt}): nothing to resume")
            return EXIT_OK
        if owing:  # training had ended, a signal stopped the stages after it: they run on the final checkpoint
            console.print(f"training finished at step {done}; {', '.join(owing)} had not: "
                          f"running the stages after training on {ckpt}", soft_wrap=True)
        else:
            console.print(f"resuming from {ckpt}" if ckpt else
                          "no complete checkpoint found: starting from the beginning")
    runner = Runner(pipeline, pm, only=args.only, from_stage=args.from_stage,
                    resume_states=states, resume_checkpoint=ckpt)
    if args.dry_run:
        print_decisions(runner)
        return EXIT_OK
    display = make_display(runner.selected(), quiet=args.quiet)
    runner.display = display
    start = time.time()
    stopped: Interrupted | None = None
    try:
        with graceful_signals(runner.interrupt):
            results = runner.run()
    except Interrupted as exc:
        stopped = exc
    except KeyboardInterrupt as exc:  # the second signal came outside the runner's loop
        stopped = Interrupted(runner.interrupt_signal or getattr(exc, "signum", signal.SIGINT), True, {}, [])
    finally:
        display.close()
    if stopped is not None:
        if not args.quiet and not stopped.aborted:
            print_summary(pipeline, stopped.results, time.time() - start)
        return report_interrupt(args, pipeline, stopped)
    if not args.quiet:
        print_summary(pipeline, results, time.time() - start)
    return EXIT_OK


def report_interrupt(args: argparse.Namespace, pipeline: Any, stopped: Interrupted) -> int:
    """Say what a signal left on disk and how to go on; the exit status is 128 + the signal."""
    from dflash_core.interrupts import exit_code
    from dflash_core.resume import finished_at, interrupted_at, latest_checkpoint, owed_after_training

    signum, name = stopped.signum, signal.Signals(stopped.signum).name
    for failure in stopped.failures:
        err_console.print(f"while stopping: stage '{failure.stage}' failed: {failure.message}")
    run_dir = pipeline.run_dir
    ckpt, step, done = latest_checkpoint(run_dir), interrupted_at(run_dir), finished_at(run_dir)
    if done is not None:
        err_console.print(f"{name}: training had finished at step {done} ({ckpt})")
        if owing := owed_after_training(pipeline, done):
            err_console.print(f"{', '.join(owing)} had not finished; resume with: {resume_command(args)}",
                              soft_wrap=True)
        return exit_code(signum)
    if step is not None:
        err_console.print(f"{name}: interrupted at step {step}, checkpoint saved: {ckpt}",
                          soft_wrap=True)
    else:
        how = "aborted" if stopped.aborted else "stopped"
        err_console.print(f"{name}: {how}, no checkpoint saved now; latest checkpoint: "
                          f"{ckpt or 'none'}")
    err_console.print(f"resume with: {resume_command(args)}", soft_wrap=True)  # one line to copy
    return exit_code(signum)


def resume_command(args: argparse.Namespace) -> str:
    """This invocation (``run``, or ``status`` of the run) as ``run --resume``: the same pipeline
    file, plugins, overrides and stages."""
    words = ["dflash-pipe", "run"]
    for plugin in args.plugin or []:
        words += ["-p", plugin]
    words.append(args.pipeline)
    for override in args.set or []:
        words += ["--set", override]
    for flag, stage in (("--only", getattr(args, "only", None)),
                        ("--from", getattr(args, "from_stage", None))):
        if stage:
            words += [flag, stage]
    return shlex.join([*words, "--resume"])


def print_decisions(runner: Any) -> None:
    """``--dry-run``: each stage, what the run would do with it and why."""
    table = Table(title=f"dry run of {runner.p.path} (run dir {runner.p.run_dir})")
    for col in ("stage", "implementation", "device", "ranks", "action", "why"):
        table.add_column(col)
    for entry in runner.decide():
        spec = runner.p.stages[entry.stage]
        ranks = ",".join(map(str, spec.ranks)) if spec.ranks else "all"
        table.add_row(entry.stage, spec.impl, spec.device, ranks, entry.action, entry.reason)
    console.print(table)


def print_summary(pipeline: Any, results: dict[str, Any], elapsed: float) -> None:
    table = Table(title=f"run finished in {elapsed:.1f}s — run dir {pipeline.run_dir}")
    for col in ("stage", "status", "time", "items", "key figures"):
        table.add_column(col)
    for stage, res in results.items():
        took = f"{res.ended - res.started:.1f}s" if res.ended and res.started else "-"
        numbers = [(k, v) for k, v in res.summary.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v:,}"
                            for k, v in numbers[:5])
        table.add_row(stage, res.status, took, f"{res.items:,}", figures)
    console.print(table)
    for stage, res in results.items():
        renderable = pipeline.stages[stage].cls.report(res.summary) if res.summary else None
        if renderable is not None:
            console.print(renderable)
