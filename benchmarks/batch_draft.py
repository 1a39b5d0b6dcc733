"""The batch drafter of evaluate's speculative decode, timed at the quality job's shape.

Each cycle of ``speculative_decode_batch`` drafts every row's block in one drafter forward
(``draft_blocks``: the rows' contexts packed as documents of one row, a dense mask for SDPA), and
reads the drafts back on the host. This times that call, synced as the loop is, for R rows of
contexts around L tokens (random weights at a preset's shape), against drafting the rows one at a
time, and says whether both give every row the same drafts. ``--profile`` adds the operations that
took the most device time in one packed call.

    python benchmarks/batch_draft.py --rows 64 --context 340 [--preset smollm2-135m] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_model.drafter import DFlashDrafter  # noqa: E402
from dflash_model.drafter.draft import draft_blocks  # noqa: E402
from dflash_model.target.load import random_config  # noqa: E402


def _synced_ms(fn: Callable[[], torch.Tensor], warmup: int, iters: int) -> list[float]:
    """Wall milliseconds of each call, its result read on the host (as the decode loop reads it:
    the read waits for the GPU's work)."""
    for _ in range(warmup):
        fn().tolist()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn().tolist()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2-135m", help="random:PRESET's shape (dflash_model/target/load.py)")
    ap.add_argument("--rows", type=int, default=64, help="rows drafted together (evaluate's batch_size)")
    ap.add_argument("--context", type=int, default=340, help="mean context tokens a row (prompt + output so far)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="the top operations of one packed call")
    args = ap.parse_args(argv)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = random_config(args.preset)
    drafter = DFlashDrafter(cfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=3,
                            attn_backend="sdpa").to(dev, dtype).eval()
    k, H, V = len(drafter.config.target_layer_ids), cfg.hidden_size, cfg.vocab_size
    embed = (torch.randn(V, H, device=dev) * 0.02).to(dtype)  # tied: the head is the embedding
    R, L = args.rows, args.context
    lengths = [L // 2 + (i * L) // R for i in range(R)]  # from L/2 to 3L/2, mean about L
    feats = [torch.randn(n, k * H, device=dev, dtype=dtype) for n in lengths]
    positions = [torch.arange(n, device=dev) for n in lengths]
    last = torch.randint(4, V, (R,)).tolist()

    def packed() -> torch.Tensor:
        return draft_blocks(drafter, feats, positions, last, embed, embed, lengths)

    def one_at_a_time() -> torch.Tensor:
        return torch.cat([draft_blocks(drafter, [f], [p], [t], embed, embed, [n])
                          for f, p, t, n in zip(feats, positions, last, lengths)])

    same = sum(a == b for a, b in zip(packed().tolist(), one_at_a_time().tolist()))
    print(f"{args.preset}, {args.layers} layers, B={args.block_size}, {R} rows of {min(lengths)}-{max(lengths)} "
          f"context tokens ({sum(lengths):,} in all), {dev.type} {dtype}")
    print(f"{'mode':<18} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, fn in (("packed", packed), ("one at a time", one_at_a_time)):
        ms = _synced_ms(fn, args.warmup, args.iters)
        print(f"{name:<18} {statistics.median(ms):>10.2f} {min(ms):>8.2f} {max(ms):>8.2f}")
    print(f"drafts equal: {same} of {R} rows")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            packed().tolist()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
