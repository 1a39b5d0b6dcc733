"""How far are a target's FP8 features from its features without FP8? Per feature layer, on one
packed row of documents, the relative error (max |a - b| / max |b|, and RMS ‖a - b‖ / ‖b‖) of:

- FP8 vs the same weights: the FP8 target (``FP8BlockLinear``: activations quantized per token in
  groups of 128, block-scaled products) against the same dequantized weights run as ordinary linear
  layers in the target's dtype: what FP8 products cost on top of the checkpoint's weights;
- FP8 vs unquantized, and the same weights vs unquantized, when the unquantized weights exist: a
  float model quantized here by our quantizer (``--model`` a float checkpoint, ``smollm2``, or a
  ``random:`` preset without ``-fp8``); a published FP8 checkpoint has none.

``--model`` is a block-scaled FP8 checkpoint directory, a ``random:NAME-fp8`` preset, or any float
target, quantized in memory (``--write DIR`` also saves it as an FP8 checkpoint directory with its
tokenizer). Documents are text from this repository's docs when the target has a tokenizer, random
ids otherwise. The targets are loaded one after another (one in memory at a time).

    python benchmarks/fp8_features.py --model random:qwen3.6-27b --tokens 8192        # H200, bf16
    python benchmarks/fp8_features.py --model /data/Qwen3.6-27B-FP8 --tokens 8192
    python benchmarks/fp8_features.py --model smollm2 --device cpu --write /tmp/smollm2-fp8
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_model.target import fp8  # noqa: E402
from dflash_model.target.capture import FeatureCapture  # noqa: E402
from dflash_model.target.features import feature_layer_ids  # noqa: E402
from dflash_model.target.load import FP8_SUFFIX, RANDOM_PREFIX, load_target  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCS = 4


def documents(tokenizer: Any, vocab: int, tokens: int, seed: int = 0) -> list[np.ndarray]:
    """``DOCS`` documents filling ``tokens``: the repository's docs/*.md tokenized (one file a
    document) when the target has a real tokenizer, random ids otherwise."""
    share = tokens // DOCS
    if hasattr(tokenizer, "encode"):
        ids = [np.asarray(tokenizer.encode(p.read_text()), np.int64) for p in sorted((REPO / "docs").glob("*.md"))]
        long = [d for d in ids if len(d) >= share]
        if len(long) >= DOCS:
            return [d[:share] for d in long[:DOCS]]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, share) for _ in range(DOCS)]


def packed(docs: list[np.ndarray]) -> dict[str, Any]:
    """A packed row (pack's fields that ``FeatureCapture.capture_row`` reads)."""
    return {"input_ids": np.concatenate(docs), "position_ids": np.concatenate([np.arange(len(d)) for d in docs]),
            "doc_lengths": [len(d) for d in docs]}


def errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max()), float((a - b).norm() / b.norm())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="FP8 checkpoint directory, random:NAME[-fp8], smollm2 or a float checkpoint")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA, fp32 elsewhere")
    p.add_argument("--tokens", type=int, default=1024, help="row length (4 documents)")
    p.add_argument("--layers", default="auto", help="feature layer ids, comma-separated (default: 5 spread over the layers, docs/drafter.md, 'Math')")
    p.add_argument("--write", help="also save the quantized float target here as an FP8 checkpoint")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()

    def load(model: str) -> tuple[nn.Module, Any]:
        return load_target(model, args.device, args.dtype, "sdpa")

    is_fp8 = (args.model.startswith(RANDOM_PREFIX) and args.model.endswith(FP8_SUFFIX)) or (
        Path(args.model).is_dir() and fp8.checkpoint_fp8_config(args.model) is not None)
    if is_fp8 and args.write:
        p.error("--write quantizes a float target; this one is FP8 already")
    # the unquantized weights: the float target itself, the float twin of a -fp8 preset, or none
    float_ref = args.model if not is_fp8 else (
        args.model[:-len(FP8_SUFFIX)] if args.model.startswith(RANDOM_PREFIX) else None)

    model, tok = load(args.model)
    if not is_fp8:
        if args.write:
            fp8.save_fp8_checkpoint(model, args.write)
            if hasattr(tok, "save_pretrained"):
                tok.save_pretrained(args.write)
            print(f"wrote {args.write}", flush=True)
        fp8.quantize_model(model)  # the quantizer the writer used: the same weights
    cfg = model.config
    layers = feature_layer_ids(args.layers if args.layers == "auto" else args.layers.split(","), 5,
                               cfg.num_hidden_layers)
    row = packed(documents(tok, cfg.vocab_size, args.tokens))
    H = cfg.hidden_size
    feats: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        feats["fp8"] = FeatureCapture(model, layers).capture_row(row)[0].cpu()
        fp8.dequantize_model(model, model.dtype)
        feats["same weights"] = FeatureCapture(model, layers).capture_row(row)[0].cpu()
        del model
        gc.collect()
        if float_ref is not None:
            model, _ = load(float_ref)
            feats["unquantized"] = FeatureCapture(model, layers).capture_row(row)[0].cpu()
            del model
    pairs = [("fp8", "same weights"), ("fp8", "unquantized"), ("same weights", "unquantized")]
    results: list[dict[str, Any]] = []
    print(f"\n{args.model}: {len(row['input_ids'])} tokens in {DOCS} documents, {args.device}, features of {layers}")
    print("| layer | compared | max rel. | RMS rel. |\n|---:|---|---:|---:|")
    for i, t in enumerate(layers):
        cols = slice(i * H, (i + 1) * H)
        for a, b in pairs:
            if a in feats and b in feats:
                mx, rms = errors(feats[a][:, cols], feats[b][:, cols])
                results.append({"layer": t, "a": a, "b": b, "max_rel": mx, "rms_rel": rms})
                print(f"| {t} | {a} vs {b} | {mx:.4f} | {rms:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "tokens": len(row["input_ids"]),
                                              "device": args.device, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
