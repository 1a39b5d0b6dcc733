"""The hybrid target's forward (Qwen3.5 / 3.6: Gated DeltaNet + gated full attention) on packed
rows: does each document get its features alone, and how fast is the hooked forward?

Default: CUDA, bf16, the Qwen3.6-27B text shape with random weights (64 layers = 16 x [3 linear +
1 full]; hidden 5120, MLP 17408; full attention 24 q / 4 kv heads of 256, partial rotary 0.25,
rope_theta 1e7; linear 16 key / 48 value heads of 128, conv width 4; vocab 248,320), rows of 8,192
and 16,384 tokens holding 4 documents of uneven lengths and some padding, features of layers
1,16,31,46,61. The target runs as the extract stage runs it (``load_feature_target`` on a ``random:``
config, ``FeatureCapture.capture_row``; flash-linear-attention's varlen kernels when installed).

Per row length:
- isolation: each document's features in the packed row against transformers' own forward of
  that document alone, max relative difference (max |a - b| / max |b|) over the linear and the
  full-attention layers read; beside it the noise floor: the same document alone once more, padded
  to the row's length, through the packed-row path (other kernels and shapes, other roundings);
- speed: the hooked forward (compiled layers on CUDA, as extract's ``compile: auto``), CUDA events,
  median after warm-up, in tokens/s and TFLOP/s (2 x parameters of the layers run x T); beside it
  transformers' own forward of the same row, whose linear layers run across the documents.
A table comes last.

    python benchmarks/hybrid_forward.py
    python benchmarks/hybrid_forward.py --config qwen3_5_text.json --tokens 8192 --reps 10
    python benchmarks/hybrid_forward.py --fp8                        # FP8 linear layers
    python benchmarks/hybrid_forward.py --fp8 --tokens 16384 --profile $OUT/prof   # + where the time goes
    python benchmarks/hybrid_forward.py --device cpu --tiny          # smoke test, fp32, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_model.fast.settings import compile_wanted
from dflash_model.target import fp8
from dflash_model.target.capture import FeatureCapture
from dflash_model.target.features import load_feature_target
from dflash_model.target.layers import decoder_layers
from dflash_model.target.linear_attention import fla_kernels
from dflash_model.target.load import PRESETS
from dflash_model.target.packed_attention import row_attention_mask
from online import timed  # noqa: E402  (benchmarks/ is the script's directory)
from train_step import profile_steps  # noqa: E402

QWEN36_27B = PRESETS["qwen3.6-27b"]
"""The text model of Qwen3.6-27B (the ``random:qwen3.6-27b`` preset; its layer types come from
the config class's default, 3 linear + 1 full attention, repeated)."""
TINY = dict(QWEN36_27B, vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
            initializer_range=0.1)
DOC_SHARES = (0.37, 0.29, 0.19, 0.11)
"""The documents' shares of a row; the remaining 4% is padding."""


def target_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config as JSON for ``load_target('random:...')``: a file, or the built-in shape."""
    if args.config:
        raw = json.loads(Path(args.config).read_text())
    else:
        raw = dict(TINY if args.tiny else QWEN36_27B)
    if args.fp8:
        raw["quantization_config"] = fp8.quantization_config()
    pattern = raw.get("layer_types")
    if pattern:  # a short pattern repeats to the layer count; none: the config class's default
        raw["layer_types"] = [pattern[i % len(pattern)] for i in range(raw["num_hidden_layers"])]
    return raw


def make_row(ids: np.ndarray, lengths: list[int], total: int) -> dict[str, Any]:
    """A row in pack's format: ``ids`` split into documents of ``lengths``, then padding to ``total``."""
    pad = total - sum(lengths)
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.arange(pad)])
    return {"input_ids": np.concatenate([ids[:sum(lengths)], np.zeros(pad, np.int64)]),
            "position_ids": pos, "doc_lengths": lengths}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def median_ms(fn: Callable[[], Any], dev: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() after ``warmup`` calls (online.py's timing: CUDA events on a GPU)."""
    times = [timed(fn, dev) * 1e3 for _ in range(warmup + reps)]
    return statistics.median(times[warmup:])


def isolation(capture: FeatureCapture, columns: dict[str, list[int]], ids: np.ndarray, total: int
              ) -> dict[str, tuple[float, float]]:
    """Layer kind -> (max rel. difference of each document's features in the packed row from the
    model's own forward of that document alone; noise floor: the same document alone again, padded
    to the row's length, through the packed-row path)."""
    dev = next(capture.model.parameters()).device
    lengths = [int(total * s) for s in DOC_SHARES]
    packed = capture.capture_row(make_row(ids, lengths, total))[0]
    worst = {kind: [0.0, 0.0] for kind in columns}
    start = 0
    for n in lengths:
        doc = ids[start:start + n]
        mask = row_attention_mask(capture.model, [n], n, capture.model.dtype, dev)  # causal
        own = capture.capture(torch.as_tensor(doc, device=dev)[None], None, mask)[0][0]  # transformers'
        padded = capture.capture_row(make_row(doc, [n], total))[0][:n]
        for kind, cols in columns.items():
            worst[kind][0] = max(worst[kind][0], rel(packed[start:start + n, cols], own[:, cols]))
            worst[kind][1] = max(worst[kind][1], rel(padded[:, cols], own[:, cols]))
        start += n
    return {kind: (a, b) for kind, (a, b) in worst.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model, fp32, short rows (smoke test)")
    p.add_argument("--config", help="a qwen3_5_text config JSON (model_type included) instead of the 27B shape")
    p.add_argument("--fp8", action="store_true", help="the linear layers in Qwen's block-scaled FP8 format "
                   "(the published Qwen3.6-27B-FP8's; dflash_model.target.fp8)")
    p.add_argument("--tokens", default=None, help="row lengths, comma-separated (default 8192,16384; tiny 256)")
    p.add_argument("--layers", default=None,
                   help="feature layer ids (default: 5 spread over the layers, docs/drafter.md, 'Math')")
    p.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA, fp32 elsewhere")
    p.add_argument("--attn", default="auto", help="auto (packed_flex on CUDA) | sdpa | packed_flex")
    p.add_argument("--compile", default="auto", help="compile the decoder layers for the timing: auto | on | off")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for profiler tables of 2 more forwards a row length: top kernels, kernel kinds, "
                        "products by shape (where the FP8 target's time goes, beside its products)")
    args = p.parse_args()
    dev = torch.device(args.device)
    tokens = [int(t) for t in (args.tokens or ("256" if args.tiny else "8192,16384")).split(",")]

    raw = target_config(args)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(raw, f)
    t0 = time.perf_counter()
    # eager for the isolation checks (their documents come in many lengths); compiled for the timing
    target = load_feature_target(f"random:{f.name}", args.device, dtype=args.dtype, attn_implementation=args.attn,
                                 layers=[int(t) for t in args.layers.split(",")] if args.layers else "auto",
                                 compile="off")
    Path(f.name).unlink()
    model, capture, layers = target.model, target.capture, target.layer_ids
    kinds = list(model.config.layer_types)
    H = model.config.hidden_size
    columns: dict[str, list[int]] = {}
    for i, t in enumerate(layers):
        columns.setdefault(kinds[t], []).extend(range(i * H, (i + 1) * H))
    run_params = sum(p.numel() for layer in decoder_layers(model)[:max(layers) + 1] for p in layer.parameters())
    mixer = "fla varlen kernels" if fla_kernels() is not None and dev.type == "cuda" else "own forward per document"
    print(f"target: {len(kinds)} layers ({kinds.count('linear_attention')} linear), hidden {H}, "
          f"{model.dtype}, attention {model.config._attn_implementation}, linear layers: {mixer}; built in "
          f"{time.perf_counter() - t0:.1f} s; features of layers {layers}", flush=True)

    rng = np.random.default_rng(0)
    checks = {T: isolation(capture, columns, rng.integers(0, raw["vocab_size"] - 1, T), T) for T in tokens}
    for T, res in checks.items():
        for kind, (diff, noise) in res.items():
            print(f"{T:>6} tokens, {kind:>16}: packed vs alone {diff:.2e}, noise floor {noise:.2e}", flush=True)

    compiled = compile_wanted(args.compile, dev)
    if compiled:
        target.compile_layers()
    speed = {}
    for T in tokens:
        row = make_row(rng.integers(0, raw["vocab_size"] - 1, T), [int(T * s) for s in DOC_SHARES], T)
        ids = torch.as_tensor(row["input_ids"], device=dev)[None]
        pos = torch.as_tensor(row["position_ids"], device=dev)[None]
        mask = row_attention_mask(model, row["doc_lengths"], T, model.dtype, dev)
        ours = median_ms(lambda: capture.capture_row(row), dev, args.warmup, args.reps)
        own = median_ms(lambda: capture.capture(ids, pos, mask), dev, args.warmup, args.reps)
        speed[T] = (ours, own)
        print(f"{T:>6} tokens: isolated {ours:.1f} ms, transformers' own (crossing) {own:.1f} ms", flush=True)
        if args.profile:
            profile_steps(lambda: capture.capture_row(row), dev,
                          args.profile / f"profile-{T}{'-fp8' if args.fp8 else ''}.txt", n=2)

    print(f"\n| tokens | kind | packed vs alone | noise floor | isolated: ms | tokens/s | TFLOP/s | "
          f"own forward (crossing): ms | tokens/s |  ({'compiled' if compiled else 'eager'})")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for T in tokens:
        ours, own = speed[T]
        for kind, (diff, noise) in checks[T].items():
            print(f"| {T} | {kind} | {diff:.2e} | {noise:.2e} | {ours:.1f} | {T / ours * 1e3:,.0f} | "
                  f"{2 * run_params * T / ours / 1e9:.0f} | {own:.1f} | {T / own * 1e3:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
