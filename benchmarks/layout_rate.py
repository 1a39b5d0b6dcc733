"""Steady tokens/s of a finished layout run (one GPU or several), from its metrics.jsonl.

    python3 benchmarks/layout_rate.py RUN_DIR --replicas R [--skip K]

The first drafter replica logs, at every logged step, the tokens it has trained on and the
seconds since it started. Data-parallel replicas train as many tokens each, so the layout's rate
is R x that replica's slope, taken over the steps after the first K: those hold the start-up
(the target's load, the drafter's compile, the queue filling) that a long run pays once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def steady_rate(records: list[dict], replicas: int, skip: int) -> dict[str, float]:
    """Tokens/s of all replicas and ms per step over the records after step ``skip``."""
    after = [r for r in records if r["step"] >= skip]
    if len(after) < 2:
        raise SystemExit(f"need at least 2 logged steps from step {skip} on, have {len(after)}")
    first, last = after[0], after[-1]
    seconds, steps = last["elapsed_s"] - first["elapsed_s"], last["step"] - first["step"]
    return {"first": first["step"], "last": last["step"], "ms_per_step": seconds / steps * 1e3,
            "tokens_per_s": replicas * (last["tokens"] - first["tokens"]) / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--replicas", type=int, default=1, help="drafter replicas (data-parallel ranks)")
    p.add_argument("--skip", type=int, default=4, help="steps left out at the start")
    args = p.parse_args()
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    rate = steady_rate(records, args.replicas, args.skip)
    print(f"{args.run_dir}: steps {rate['first']}..{rate['last']}: {rate['ms_per_step']:.1f} ms/step per "
          f"replica, {args.replicas} replica(s): {rate['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
