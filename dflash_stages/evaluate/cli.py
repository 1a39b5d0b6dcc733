"""``dflash-pipe evaluate EXPORT_DIR``: serve an exported drafter with real speculative decoding.

Without options it uses the target and held-out prompts recorded with the run that produced the
export (``config.json`` → ``dflash_pipe``). Exit 0 when the output is lossless, 1 when any output
differs from the target's greedy decode (or with ``--fail-on-gap`` when the train/serve gap is
flagged), 2 for bad inputs (no target / prompts recorded, export for another target).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dflash_core.cli.common import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, console, err_console

CPU_PROMPTS = 8
"""Prompts evaluated on the CPU unless --num-prompts says otherwise: a few minutes, not a quarter hour."""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("evaluate", parents=[common],
                       help="measure an exported drafter's acceptance length τ by real speculative decoding")
    p.add_argument("export", metavar="EXPORT_DIR", help="exported drafter directory (config.json + model.safetensors)")
    p.add_argument("--target", help="target model: path, hub name or 'smollm2' (default: recorded in the export)")
    p.add_argument("--prompts", help="JSONL of records (messages / prompt) (default: the run's held-out set)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"use the first N prompts (default: all on a GPU, {CPU_PROMPTS} on the CPU)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--out", help="report directory (default: EXPORT_DIR/eval)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32")
    p.add_argument("--metrics", help="training metrics.jsonl for the plot (default: recorded in the export)")
    p.add_argument("--no-baseline", action="store_true", help="skip the n-gram baseline")
    p.add_argument("--gap-threshold", type=float, default=0.10, help="flag |τ_sim − τ| / τ_sim above this (0.10)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="prompts decoded together, one target forward per cycle for all (default 16)")
    p.add_argument("--tie-tolerance", type=float, default=None,
                   help="relative logit gap of a tolerated near tie (default by dtype: fp32 1e-4, fp16 1e-2, "
                        "bf16 5e-2; at least 2^-3 for a target with FP8 layers)")
    p.add_argument("--reference", metavar="DIR",
                   help="share the target's greedy reference with other evaluations naming DIR: read it from there "
                        "if one of this target, dtype, prompts and length is, else decode it and write it there "
                        "(τ_ref then scores their drafters on one text)")
    p.add_argument("--fail-on-gap", action="store_true", help="exit 1 when the train/serve gap is flagged")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_stages.evaluate.drafter import EvaluationError, progress_line
    from dflash_stages.evaluate.export import evaluate_export
    from dflash_stages.evaluate.report import render_table

    device = args.device or _default_device()
    out = args.out or os.path.join(args.export.removeprefix("file://"), "eval")
    if "://" in args.export and not args.out:
        out = os.path.join(".", "eval")

    num_prompts = args.num_prompts
    if num_prompts is None and device == "cpu":
        num_prompts = CPU_PROMPTS
        err_console.print(f"on the CPU: the first {CPU_PROMPTS} prompts (--num-prompts N for more)", markup=False)

    def progress(phase: str, done: int, total: int, tau: float | None) -> None:
        if not getattr(args, "quiet", False):
            err_console.print(progress_line(phase, done, total, tau), markup=False)

    try:
        report = evaluate_export(args.export, target=args.target, prompts=args.prompts, num_prompts=num_prompts,
                                 max_new_tokens=args.max_new_tokens, device=device, dtype=args.dtype, out_dir=out,
                                 metrics=args.metrics, baseline=not args.no_baseline,
                                 gap_threshold=args.gap_threshold, progress=progress,
                                 batch_size=args.batch_size, tie_tolerance=args.tie_tolerance,
                                 reference_dir=args.reference)
    except (EvaluationError, FileNotFoundError) as exc:
        err_console.print(f"error: {exc}", markup=False)
        return EXIT_CONFIG
    console.print(render_table(report))
    if not report["lossless"]:
        return EXIT_FAILED
    if args.fail_on_gap and report["gap_flag"]:
        return EXIT_FAILED
    return EXIT_OK


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
