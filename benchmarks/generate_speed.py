"""Tokens per second of the generate stage's decode loop: batches one after another against one call
that keeps its rows in flight (continuous batching), with the target's attention implementations
side by side, on real prompts.

    python benchmarks/generate_speed.py --model smollm2 --device cuda:0 \
        --prompts pipelines/data/sharegpt/train.jsonl --num-prompts 2048 --batch-size 1024 \
        --attention sdpa --attention sdpa_grouped

The prompts are the first ``--num-prompts`` usable ones of the file, rendered with the chat template
and sorted longest first, as the stage does. "batches" calls ``complete`` on each ``--batch-size``
slice (finished rows leave the cache, none join: the tail of each batch runs with few rows);
"in flight" is one call over all of them (finished rows are replaced by waiting prompts). Each
``--attention`` loads the target with that implementation (``sdpa``: K/V heads repeated for grouped
queries; ``sdpa_grouped``: read as they are, dflash_model.target.decode_kv). All decode greedily to
``--max-new-tokens``; the table gives seconds, tokens/s, the GPU's busy share (NVML), the peak memory
and how many outputs equal the first run's (bf16 near ties may part them).

``--profile PATH`` then runs the torch profiler over one in-flight call of the first ``--batch-size``
prompts for ``--profile-steps`` decode steps and writes its operator tables (host time first, then
GPU time) to PATH: where a decode step's time goes when the GPU is not kept busy.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prompts", default="pipelines/data/sharegpt/train.jsonl")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, action="append", help="rows in flight (repeatable); default 1024")
    ap.add_argument("--attention", action="append", choices=("sdpa", "sdpa_grouped", "eager"),
                    help="the target's attention (repeatable); default sdpa_grouped")
    ap.add_argument("--mode", action="append", choices=("batches", "in-flight"),
                    help="how the prompts are fed (repeatable); default both")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-batch-tokens", type=int, help="the stage's max_batch_tokens, in every run")
    ap.add_argument("--profile", metavar="PATH", help="write the profiler's operator tables of one call here")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps of the profiled call")
    args = ap.parse_args()

    import torch

    from dflash_model.target.generate import GpuBusy, complete
    from dflash_model.target.load import load_target
    from dflash_stages.generate.prompts import PromptError, eos_ids, read_records, record_messages, render_prompt

    attentions = args.attention or ["sdpa_grouped"]
    model, tok = load_target(args.model, device=args.device, attn_implementation=attentions[0])
    prompts: list[list[int]] = []
    for record in read_records(args.prompts):
        try:
            ids = render_prompt(tok, record_messages(record))
        except PromptError:
            continue
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.num_prompts:
            break
    prompts.sort(key=lambda p: -len(p))
    eos = sorted(eos_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    dev = torch.device(args.device)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, max_new_tokens {args.max_new_tokens}, "
          f"max_batch_tokens {args.max_batch_tokens}", flush=True)

    def run(batch: int, in_flight: bool) -> tuple[float, list[list[int]], float | None, float | None]:
        slices = [prompts] if in_flight else [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        with GpuBusy(dev) as busy:
            t0 = time.perf_counter()
            out = [c.ids for part in slices for c in complete(model, part, batch_size=batch, eos=eos, pad_id=pad,
                                                             max_new_tokens=args.max_new_tokens,
                                                             max_batch_tokens=args.max_batch_tokens)]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        return seconds, out, busy.share, peak

    rows, first = [], None
    for i, attention in enumerate(attentions):
        if i:
            del model
            model, _ = load_target(args.model, device=args.device, attn_implementation=attention)
        complete(model, prompts[-8:], batch_size=8, eos=eos, pad_id=pad, max_new_tokens=8)  # warm-up
        for batch in args.batch_size or [1024]:
            for mode in args.mode or ["batches", "in-flight"]:
                seconds, out, busy, peak = run(batch, mode == "in-flight")
                tokens = sum(map(len, out))
                same = "-" if first is None else f"{sum(a == b for a, b in zip(first, out))}/{len(out)}"
                first = first or out
                rows.append((attention, batch, mode, seconds, tokens, busy, peak, same))
                print(f"{attention} batch {batch} {mode}: {seconds:.1f} s, {tokens / seconds:,.0f} tokens/s", flush=True)
    if args.profile:
        profile(model, prompts[:(args.batch_size or [1024])[0]], eos, pad, args.profile_steps, args.profile)
    print(f"\n{'attention':<13} {'batch':>6} {'mode':<10} {'s':>7} {'tokens':>9} {'tokens/s':>9} {'GPU busy':>8} "
          f"{'peak GiB':>8} {'same':>9}")
    for attention, batch, mode, seconds, tokens, busy, peak, same in rows:
        shown = f"{busy:.0%}" if busy is not None else "-"
        gib = f"{peak:.1f}" if peak is not None else "-"
        print(f"{attention:<13} {batch:>6} {mode:<10} {seconds:7.1f} {tokens:9d} {tokens / seconds:9,.0f} {shown:>8} "
              f"{gib:>8} {same:>9}")


def profile(model, prompts: list[list[int]], eos: list[int], pad: int, steps: int, path: str) -> None:
    """The profiler's operator tables of one in-flight call, host time first: a host-bound step shows
    its cost (launches, synchronizations, Python) in the first, the kernels in the second."""
    import torch
    from torch.profiler import ProfilerActivity

    from dflash_model.target.generate import complete

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        complete(model, prompts, batch_size=len(prompts), eos=eos, pad_id=pad, max_new_tokens=steps)
    table = prof.key_averages()
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{len(prompts)} prompts, {steps} decode steps\n\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
        if torch.cuda.is_available():
            f.write(table.table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
    print(f"profile of {len(prompts)} prompts x {steps} steps: {path}", flush=True)


if __name__ == "__main__":
    main()
