"""Online training throughput on one GPU: target forward alone, drafter step alone, the two
back to back, and the whole pipeline (pack:random -> extract -> train) through the runner.

    python benchmarks/online.py                                   # Qwen3-8B dims, 8,192-token rows
    python benchmarks/online.py --preset qwen3-32b --layers 1,16,31,46,61 --rows 12
    python benchmarks/online.py --device cpu --preset tiny --rows 4 --warmup 1 --anchors 32 --tokens 512
                                                                  # smoke test (the defaults are slow on a CPU)
    python benchmarks/online.py --tokens 16384 --attn both --target-only   # sdpa vs packed_flex
    python benchmarks/online.py --preset qwen3.6-27b-fp8 --tokens 16384 --rows 6 --warmup 2 \
        --lm-head fp8 --mlp fp8                                   # the FP8 target and drafter products

Random weights at real shapes (nothing downloaded). FLOPs: docs/drafter.md, 'FLOP model' (target forward =
2 x non-embedding params x T + causal attention within documents).

``--attn``: the target's attention on packed rows — sdpa (4D additive mask), packed_flex
(flex_attention + document-causal BlockMask, dflash_model/target/packed_attention.py), auto (packed_flex
on CUDA, sdpa elsewhere: what extract uses by default), or both (each timed on the same rows; the
drafter and pipeline parts then use auto's choice).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.devices import use_device
from dflash_core.stage import StageContext
from dflash_model.drafter import (
    build_blocks,
    doc_ids_from_lengths,
    sample_anchors,
    training_flops,
)
from dflash_model.target.features import load_feature_target
from dflash_model.target.load import PRESETS
from dflash_model.target.packed_attention import NAME as FLEX
from dflash_model.target.packed_attention import register, resolve_attn_implementation
from dflash_stages.pack.random_rows import RandomRowsConfig, random_row
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.trainer import Trainer

def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds for fn(), by CUDA events on a GPU, by the clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def say(msg: str) -> None:
    """Progress on stderr as each part finishes, so a run cut short by a time limit still has figures."""
    print(msg, file=sys.stderr, flush=True)


def target_flops(model: torch.nn.Module, lengths: list[int], top_layer: int) -> float:
    """Forward FLOPs up to ``top_layer`` (the extract stops there): 2·params·T + attention."""
    cfg = model.config
    L = cfg.num_hidden_layers
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n)
    frac = (top_layer + 1) / L
    T = sum(lengths)
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * sum(n * (n + 1) / 2 for n in lengths)
    return frac * (2 * layer_params * L * T + L * attn)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per row; default 8192 on CUDA, 2048 on CPU (a smoke test there: "
                        "flex_attention runs eager and unfused on CPU, many times slower)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", default="auto")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", FLEX, "both"],
                   help="target attention (see the module docstring); both = sdpa and packed_flex")
    p.add_argument("--compile-target", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the target's decoder layers, as extract's compile option (auto: on CUDA)")
    p.add_argument("--train-device", default=None,
                   help="the pipeline's train stage on another device (e.g. cuda:1: target and drafter on "
                        "two GPUs); the parts alone and back to back stay on --device")
    p.add_argument("--lm-head", default="model", choices=["model", "fp8"],
                   help="train's lm_head_dtype: the loss's LM-head products in FP8 (docs/fp8_target.md)")
    p.add_argument("--mlp", default="model", choices=["model", "fp8"],
                   help="train's mlp_dtype: the draft layers' MLP products in FP8 (docs/fp8_target.md)")
    p.add_argument("--target-only", action="store_true",
                   help="time the target forward only: no drafter, back-to-back or pipeline part")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dev = use_device(args.device)
    args.device = str(dev)  # the pipeline part runs on this same device
    if args.tokens is None:
        args.tokens = 8192 if dev.type == "cuda" else 2048
    dtype_name = "bf16" if dev.type == "cuda" else "float32"
    layers = "auto" if args.layers == "auto" else [int(x) for x in args.layers.split(",")]
    res: dict[str, Any] = {"preset": args.preset, "tokens": args.tokens, "device": str(dev),
                           "lm_head_dtype": args.lm_head, "mlp_dtype": args.mlp,
                           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    attn = resolve_attn_implementation("auto" if args.attn == "both" else args.attn, dev)
    variants = ["sdpa", FLEX] if args.attn == "both" else [attn]
    res["attn"] = attn

    loaded, rows, forward, vocab = time_target(args, dev, dtype_name, res, layers, attn, variants)
    if args.target_only:
        if dev.type == "cuda":
            res["peak_gib_parts"] = torch.cuda.max_memory_allocated(dev) / 2**30
        report(res, args)
        return
    work = tempfile.mkdtemp()
    b2b_s = time_drafter(args, dev, dtype_name, res, loaded, rows, forward, work)
    ids = loaded.layer_ids
    loaded = forward = None  # free GPU memory for the pipeline run
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    time_pipeline(args, dtype_name, res, ids, vocab, b2b_s, work)


def time_target(args: argparse.Namespace, dev: torch.device, dtype_name: str, res: dict[str, Any],
                layers: str | list[int], attn: str, variants: list[str]
                ) -> tuple[Any, list[dict[str, Any]], Callable[..., torch.Tensor], int]:
    """The target forward alone, in each attention variant, loaded as extract loads it: (the
    loaded target, the rows, extract's per-row forward, the rows' vocabulary)."""
    model_ref = f"random:{args.preset}"
    loaded = load_feature_target(model_ref, args.device, dtype=dtype_name, attn_implementation=variants[0],
                                 layers=layers, compile=args.compile_target)  # as extract loads it
    target, cap, ids = loaded.model, loaded.capture, loaded.layer_ids
    res["target_init_s"] = loaded.load_s
    res["layer_ids"] = ids
    res["target_compiled"] = loaded.compiled
    rcfg = RandomRowsConfig(rows=args.rows, tokens_per_row=args.tokens, vocab_size=target.config.vocab_size - 1)
    rows = [random_row(rcfg, i) for i in range(args.rows)]

    def use_attn(impl: str) -> None:
        """Switch the loaded target's attention implementation in place (same weights)."""
        if impl == FLEX:
            register()
        if target.config._attn_implementation != impl:
            target.set_attn_implementation(impl)
        if target.config._attn_implementation != impl:
            raise RuntimeError(f"could not switch the target to {impl}")

    def forward(row: dict[str, Any]) -> torch.Tensor:
        """The extract stage's per-row work (its mask follows the current implementation)."""
        return cap.capture_row(row)[0]

    tf = target_flops(target, rows[0]["doc_lengths"], max(ids))
    res["target"] = {}
    first_feats: dict[str, torch.Tensor] = {}
    for impl in variants:
        use_attn(impl)
        say(f"target forward ({impl}): first row...")
        fwd = [timed(lambda r=r: forward(r), dev) for r in rows]
        fwd_s = statistics.median(fwd[args.warmup:])
        res["target"][impl] = {"first_s": fwd[0], "ms": fwd_s * 1e3, "tok_s": args.tokens / fwd_s,
                               "tflops": tf / fwd_s / 1e12}
        say(f"target forward ({impl}): first {fwd[0]:.1f} s, then {fwd_s * 1e3:.1f} ms/row = "
            f"{args.tokens / fwd_s:,.0f} tok/s, {tf / fwd_s / 1e12:.1f} TFLOP/s")
        first_feats[impl] = forward(rows[0])
    if len(variants) > 1:  # the same features either way (bf16 rounding aside)
        a, b = (first_feats[v].float() for v in variants)
        res["attn_max_abs_diff"] = (a - b).abs().max().item()
        res["attn_rel_diff"] = ((a - b).norm() / a.norm()).item()
        a = b = None
    first_feats.clear()
    use_attn(attn)
    main_t = res["target"][attn]
    res.update(target_ms=main_t["ms"], target_tok_s=main_t["tok_s"], target_tflops=main_t["tflops"])
    return loaded, rows, forward, rcfg.vocab_size


def time_drafter(args: argparse.Namespace, dev: torch.device, dtype_name: str, res: dict[str, Any], loaded: Any,
                 rows: list[dict[str, Any]], forward: Callable[..., torch.Tensor], work: str) -> float:
    """The trainer's step alone (``Trainer.train_step``), then extract's forward and the step back
    to back; returns the back-to-back seconds per row."""
    header = loaded.header()
    tcfg = TrainConfig(num_layers=args.draft_layers, block_size=16, num_anchors=args.anchors, dtype=dtype_name,
                       lm_head_dtype=args.lm_head, mlp_dtype=args.mlp)
    trainer = Trainer(tcfg, StageContext(stage="train", config=tcfg, device=args.device, run_dir=work,
                                         work_dir=work))
    trainer.setup(header)
    feats = forward(rows[0])

    def step(row: dict[str, Any], f: torch.Tensor) -> None:
        trainer.train_step([dict(row, features=f)])

    first = timed(lambda: step(rows[0], feats), dev)
    stp = [timed(lambda r=r: step(r, feats), dev) for r in rows]
    step_s = statistics.median(stp[args.warmup:])
    r0 = rows[0]
    docs = doc_ids_from_lengths(r0["doc_lengths"], args.tokens)
    anchors = sample_anchors(torch.as_tensor(r0["loss_mask"]).long(), r0["doc_lengths"], args.anchors,
                             torch.Generator().manual_seed(0))
    _, _, layout = build_blocks(torch.as_tensor(r0["input_ids"]), torch.as_tensor(r0["position_ids"]), docs,
                                anchors, 16, 0)
    df = training_flops(trainer.model.config, args.tokens, int(anchors.numel()), layout.attended_pairs())["step"]
    res.update(drafter_first_step_s=first, drafter_ms=step_s * 1e3, drafter_tok_s=args.tokens / step_s,
               drafter_tflops=df / step_s / 1e12)

    b2b = [timed(lambda r=r: step(r, forward(r)), dev) for r in rows]
    b2b_s = statistics.median(b2b[args.warmup:])
    res.update(back_to_back_ms=b2b_s * 1e3, back_to_back_tok_s=args.tokens / b2b_s)
    say(f"drafter step {step_s * 1e3:.1f} ms (first {first:.1f} s); back to back {b2b_s * 1e3:.1f} ms/row; "
        "now the pipeline...")
    if dev.type == "cuda":
        res["peak_gib_parts"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return b2b_s


def time_pipeline(args: argparse.Namespace, dtype_name: str, res: dict[str, Any], ids: list[int], vocab: int,
                  b2b_s: float, work: str) -> None:
    """The whole pipeline (pack:random -> extract -> train) through the runner, in threads."""
    model_ref, attn, dev = f"random:{args.preset}", res["attn"], torch.device(args.device)
    from dflash_core.pipeline_file import load_pipeline_text
    from dflash_core.plugins import PluginManager
    from dflash_core.runner import Runner

    skip = 10  # > the stream queue bound (8): rows queued while the drafter compiled are excluded
    n_rows = max(args.rows * 2, skip + 14)
    yaml_text = f"""
version: 1
run_dir: {work}/run
stages:
  pack: {{uses: pack:random, params: {{rows: {n_rows}, tokens_per_row: {args.tokens}, vocab_size: {vocab}}}}}
  extract: {{uses: hf_hooks, after: pack, device: {args.device},
            params: {{model: "{model_ref}", layers: {json.dumps(ids)}, attn_implementation: {attn},
                      compile: "{args.compile_target}"}}}}
  train: {{uses: dflash, after: extract, device: {args.train_device or args.device},
          params: {{num_layers: {args.draft_layers}, num_anchors: {args.anchors}, log_every: 1, dtype: {dtype_name},
                    lm_head_dtype: {args.lm_head}, mlp_dtype: {args.mlp}}}}}
"""
    pm = PluginManager(autoload=False)
    pipeline = load_pipeline_text(yaml_text, pm)
    t0 = time.perf_counter()
    Runner(pipeline, pm).run()
    res["pipeline_wall_s"] = time.perf_counter() - t0
    res["pipeline_train_device"] = args.train_device or args.device
    with open(f"{work}/run/metrics.jsonl") as f:
        metrics = [json.loads(x) for x in f]
    # steady state: the second half of the steps after the first `skip`. Rows queued while the
    # drafter compiled drain over the first steps; when the drafter is faster than the target
    # (on its own GPU) that takes ~queue / (1 - step/forward) steps, and timing them would
    # credit the pipeline with rows made during the compile
    steady = metrics[skip + (len(metrics) - skip) // 2:]
    pipe_s = (steady[-1]["time"] - steady[0]["time"]) / (len(steady) - 1)
    pipe_tok_s = args.tokens / pipe_s
    after = metrics[skip:]  # the whole window after the first steps: an estimate that includes the drain
    res["pipeline_ms_after_skip"] = (after[-1]["time"] - after[0]["time"]) / (len(after) - 1) * 1e3
    res.update(pipeline_rows=n_rows, pipeline_steady_rows=len(steady) - 1,
               pipeline_tok_s=pipe_tok_s, pipeline_ms=args.tokens / pipe_tok_s * 1e3,
               overhead_vs_back_to_back=(args.tokens / pipe_tok_s) / b2b_s - 1)
    if dev.type == "cuda":
        res["peak_gib_pipeline"] = torch.cuda.max_memory_allocated(dev) / 2**30
        if args.train_device and args.train_device != args.device:
            res["peak_gib_pipeline_train_device"] = torch.cuda.max_memory_allocated(args.train_device) / 2**30
    report(res, args)


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the JSON (with --out), print it and the table."""
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"online-{args.preset}-{args.tokens}{'-target' if args.target_only else ''}.json"
        (args.out / name).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"\n{'what':34s} {'ms/row':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s}")
    for impl, t in res["target"].items():
        what = f"target forward ({impl}{', 4D mask' if impl in ('sdpa', 'eager') else ''})"
        print(f"{what:34s} {t['ms']:9.1f} {t['tok_s']:10.0f} {t['tflops']:8.1f}")
    if "attn_rel_diff" in res:
        print(f"features sdpa vs {FLEX}: max |diff| {res['attn_max_abs_diff']:.3g}, "
              f"relative {res['attn_rel_diff']:.3g}")
    if args.target_only:
        return
    fp8 = " + ".join(f"FP8 {part}" for part, on in (("head", args.lm_head == "fp8"), ("MLP", args.mlp == "fp8")) if on)
    label = f"drafter step ({fp8})" if fp8 else "drafter step"
    print(f"{label:34s} {res['drafter_ms']:9.1f} {res['drafter_tok_s']:10.0f} {res['drafter_tflops']:8.1f}")
    print(f"{'back to back':34s} {res['back_to_back_ms']:9.1f} {res['back_to_back_tok_s']:10.0f}")
    where = "" if res["pipeline_train_device"] == res["device"] else f", train on {res['pipeline_train_device']}"
    print(f"{'pipeline (runner, threads' + where + ')':34s} {res['pipeline_ms']:9.1f} {res['pipeline_tok_s']:10.0f}")
    print(f"pipeline overhead vs back to back: {res['overhead_vs_back_to_back'] * 100:+.1f}%")


if __name__ == "__main__":
    main()
