"""Quality of a drafter trained by the pipeline: served τ vs the n-gram baseline vs τ_sim.

    python benchmarks/quality.py --export RUN_DIR/checkpoints/step-XXXXXXX/export \
        [--target smollm2] [--prompts pipelines/data/default/heldout.jsonl] [--num-prompts 32] \
        [--max-new-tokens 128] [--batch-size 16] [--device cuda] [--dtype auto] [--out DIR]

Defaults: target and prompts recorded in the export (``config.json`` → ``dflash_pipe``), else
``smollm2`` and ``pipelines/data/default/heldout.jsonl``. dtype auto = bf16 on CUDA (the serving
dtype; the lossless check tolerates near ties, docs/evaluate.md), fp32 on CPU. Prints one table
and the greedy vs speculative tokens/s, and writes ``quality.json``
(the full evaluate report plus training time/tokens from the export's metrics log) and the PNG.
Exit 1 if any output differs from the target's greedy decode.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True, help="exported drafter directory")
    ap.add_argument("--target", default=None, help="default: recorded in the export, else smollm2")
    ap.add_argument("--prompts", default=None,
                    help="default: recorded held-out set, else pipelines/data/default/heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="default: EXPORT/eval-quality")
    args = ap.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from dflash_core.artifacts import write_json
    from dflash_model.drafter import read_export_config
    from dflash_stages.evaluate.export import evaluate_export
    from dflash_stages.evaluate.report import clean_json, render_table

    console = Console(highlight=False)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta = read_export_config(args.export).get("dflash_pipe") or {}
    target = args.target or meta.get("target") or "smollm2"
    prompts = args.prompts or meta.get("heldout") or str(REPO / "pipelines" / "data" / "default" / "heldout.jsonl")
    if not os.path.exists(prompts):
        console.print(f"no prompts file {prompts}: pass --prompts")
        return 2
    out = args.out or os.path.join(args.export, "eval-quality")
    t0 = time.perf_counter()

    report = evaluate_export(args.export, target=target, prompts=prompts, num_prompts=args.num_prompts,
                             max_new_tokens=args.max_new_tokens, device=device, dtype=args.dtype, out_dir=out,
                             batch_size=args.batch_size)
    wall = time.perf_counter() - t0
    console.print(render_table(report))

    tr = report.get("training") or {}
    t = Table(title="quality summary")
    t.add_column("figure")
    t.add_column("value", justify="right")
    speed = report["timing"]
    rows = [
        ("target / device / dtype", f"{report['target']} / {device} / {report['dtype']}"),
        ("prompts × max_new_tokens", f"{report['num_prompts']} × {report['max_new_tokens']}"),
        ("τ DFlash (served)", f"{report['tau']:.3f}"),
        ("τ n-gram baseline", f"{report['tau_ngram']:.3f}" if report.get("tau_ngram") is not None else "-"),
        ("τ_sim (teacher-forced, same prompts)", f"{report['tau_sim']:.3f}" if report.get("tau_sim") else "-"),
        ("gap (τ_sim − τ)/τ_sim", f"{report['gap'] * 100:+.1f}%{'  FLAGGED' if report['gap_flag'] else ''}"
         if report.get("gap") is not None else "-"),
        ("lossless (identical / near ties / mismatches)",
         f"{'yes' if report['lossless'] else 'NO'} ({report['identical']} / {len(report['near_ties'])} / "
         f"{len(report['mismatches'])})"),
        ("wall time greedy / DFlash / n-gram (s)",
         f"{speed['greedy_s']:.1f} / {speed['spec_s']:.1f} / {speed.get('ngram_s', float('nan')):.1f}"),
        (f"tokens/s, batch {args.batch_size}: HF greedy / DFlash / n-gram",
         f"{report['throughput']['greedy_tokens_per_s']} / {report['throughput']['spec_tokens_per_s']} / "
         f"{(report.get('ngram') or {}).get('tokens_per_s', '-')}"),
        ("training steps", str(tr.get("steps", "-"))),
        ("training τ_sim (last log) / loss", f"{tr.get('tau_sim_train')} / {tr.get('loss')}"),
        ("training time (s)", str(tr.get("train_time_s", "not in the metrics log"))),
        ("training tokens", str(tr.get("train_tokens", "not in the metrics log"))),
        ("mean training tokens/s", f"{tr['tokens_per_s_mean']:.0f}" if tr.get("tokens_per_s_mean") else "-"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    summary = {"benchmark": "quality", "wall_s": round(wall, 1), **{k: report.get(k) for k in (
        "target", "dtype", "num_prompts", "max_new_tokens", "tau", "tau_ngram", "tau_sim", "gap", "gap_flag",
        "lossless", "identical", "training", "timing", "throughput")}, "device": device, "report": report}
    path = os.path.join(out, "quality.json")
    write_json(path, clean_json(summary))
    console.print(f"wrote {path} and {report.get('files', {}).get('png')}")
    return 0 if report["lossless"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
