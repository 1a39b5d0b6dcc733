"""τ against training tokens: the trainer's τ_sim over the run and the served τ of evaluated checkpoints.

    python benchmarks/tau_curve.py --metrics RUN_DIR/metrics.jsonl \
        --report RUN_DIR/work/evaluate/step-0001140/report.json [--report …] --out docs/quality_tau_curve.png

Prints a table (training tokens, τ_sim of the training log around there, served τ, n-gram τ and
held-out τ_sim at every anchor of each report) and writes the PNG: τ_sim (training rows) as a line,
each report's figures as points at its step's training tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    ap.add_argument("--report", action="append", default=[], help="an evaluate report.json (repeatable)")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = [json.loads(x) for x in Path(args.metrics).read_text().splitlines() if x.strip()]
    log = [r for r in log if "step" in r and "tokens" in r]
    tokens_at = {r["step"]: r["tokens"] for r in log}
    reports = [json.loads(Path(p).read_text()) for p in args.report]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["tokens"] / 1e6 for r in log], [r["tau_sim"] for r in log], label="τ_sim, training rows (log)")
    print(f"{'step':>6} {'train tokens':>13} {'τ_sim (log)':>12} {'τ served':>9} {'τ n-gram':>9} {'τ_sim held-out':>13}")
    for rep in reports:
        step = rep["step"]
        at = max((s for s in tokens_at if s <= step), default=None)
        x = tokens_at[at] / 1e6 if at is not None else float("nan")
        ax.scatter([x], [rep["tau"]], color="C1", zorder=3, label="τ served (held-out prompts)")
        if rep.get("tau_ngram") is not None:
            ax.scatter([x], [rep["tau_ngram"]], color="C2", marker="s", zorder=3, label="τ n-gram (same prompts)")
        ax.scatter([x], [rep["tau_sim_all"]], color="C3", marker="^", zorder=3,
                   label="τ_sim, held-out outputs, every anchor")
        sim_log = next(r["tau_sim"] for r in log if r["step"] == at) if at is not None else float("nan")
        ngram = f"{rep['tau_ngram']:>9.3f}" if rep.get("tau_ngram") is not None else f"{'-':>9}"
        print(f"{step:>6} {x * 1e6:>13,.0f} {sim_log:>12.3f} {rep['tau']:>9.3f} {ngram} {rep['tau_sim_all']:>13.3f}")
    for r in log[:: max(1, len(log) // 8)]:
        print(f"{r['step']:>6} {r['tokens']:>13,} {r['tau_sim']:>12.3f}")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xlabel("training tokens (millions, padding included)")
    ax.set_ylabel("τ (accepted drafts + 1 per cycle)")
    ax.set_title(args.title or "τ against training tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
