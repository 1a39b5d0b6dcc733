"""Steady tokens/s of a finished layout run (one GPU or several), from its metrics.jsonl.

    python3 benchmarks/layout_rate.py RUN_DIR --replicas R [--last N]

The first drafter replica logs, at every step (``log_every: 1``), the tokens it has trained on
and the seconds since it started. A short run has two phases besides the steady one: at the start
the drafter drains rows that queued while it was set up and compiled (steps at the drafter's own
speed), and at the end it trains on rows left after the target finished. So the rate is taken
from the median time of the N steps before the last one, when rows arrive as fast as the layout
makes them; data-parallel replicas train as many tokens each, so the layout's rate is R x one
replica's. The step times are printed too, to show the phases.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def steady_rate(records: list[dict], replicas: int, last: int) -> dict[str, float]:
    """ms per step (median of the ``last`` steps before the final one) and tokens/s of all replicas."""
    if len(records) < last + 2:
        raise SystemExit(f"need {last + 2} logged steps (log_every: 1), have {len(records)}")
    window = records[-last - 2:-1]  # the final step is left out: it may hold the run's tail
    pairs = list(zip(window, window[1:]))
    ms = statistics.median((b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]) * 1e3 for a, b in pairs)
    tokens = (window[-1]["tokens"] - window[0]["tokens"]) / (window[-1]["step"] - window[0]["step"])
    return {"first": window[1]["step"], "last": window[-1]["step"], "ms_per_step": ms,
            "tokens_per_s": replicas * tokens / (ms / 1e3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--replicas", type=int, default=1, help="drafter replicas (data-parallel ranks)")
    p.add_argument("--last", type=int, default=5, help="steps the median is taken over")
    args = p.parse_args()
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [f"{b['step']}:{(b['elapsed_s'] - a['elapsed_s']) * 1e3:.0f}" for a, b in zip(records, records[1:])]
    print("ms per step (step:ms): " + " ".join(times))
    rate = steady_rate(records, args.replicas, args.last)
    print(f"{args.run_dir}: steps {rate['first']}..{rate['last']}: median {rate['ms_per_step']:.1f} ms/step per "
          f"replica, {args.replicas} replica(s): {rate['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
