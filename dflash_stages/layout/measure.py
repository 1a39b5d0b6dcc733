"""The one-GPU rates ``dflash-pipe plan`` predicts from: a short timing of the pipeline's own target
forward and drafter step on one device.

The target is loaded and run as the extract stage runs it (``load_target``, the stage's layer-id
rule, ``FeatureCapture``, the row's mask from ``row_attention_mask`` for the implementation in use);
the drafter step is the train stage's ``Trainer`` (``setup``, ``_forward_backward``,
``_optimizer_step``), on random packed rows (``random_row``) of the pipeline's row length. The
target is freed before the drafter is built, so each peak is its own: what a GPU of a pairs or
fan-in layout holds.

torch is imported inside :func:`measure` only: :func:`feature_dims` (what the ``--rates`` path
needs) reads config files and stays cheap.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SMOLLM2_HIDDEN = 576  # SmolLM2-135M-Instruct (the bundled GGUF target)


@dataclass(frozen=True)
class Measured:
    device: str
    tokens: int
    """Tokens per row (T)."""
    rows: int
    """Timed repetitions of each part (after one warm-up)."""
    attn: str
    layers: list[int]
    target_load_s: float
    target_warmup_s: float
    target_ms: float
    """Median target forward per row."""
    target_tok_s: float
    target_gib: float | None
    """Peak allocated GiB of the target (weights + one forward); None off CUDA."""
    drafter_warmup_s: float
    """First drafter step (compiles on CUDA: minutes cold, seconds from a compile cache)."""
    drafter_ms: float
    """Median optimizer step (``rows_per_step`` rows)."""
    drafter_tok_s: float
    drafter_gib: float | None
    compiled: bool
    hidden_size: int
    feature_rows: int
    """k (+1 with last_hidden): hidden-state rows per token that cross to the drafter."""
    drafter_params: int
    """Trainable drafter parameters (what the replicas' all-reduce moves, in float32)."""
    gpu_gib: float | None
    """Total memory of the measuring GPU; None off CUDA."""
    compile_cache_saved: str | None = None


def feature_dims(extract_cfg: Any) -> tuple[int | None, int]:
    """(hidden size or None when it cannot be read without loading the model, k) for an extract
    stage's config; k counts ``last_hidden`` as one more row. Reads local ``config.json`` files, the
    ``random:`` presets and the Hugging Face cache; never the network."""
    k = (int(extract_cfg.num_features) if extract_cfg.layers == "auto" else len(extract_cfg.layers))
    k += 1 if getattr(extract_cfg, "last_hidden", False) else 0
    return _hidden_size(str(extract_cfg.model)), k


def _hidden_size(model: str) -> int | None:
    def from_json(path: str) -> int | None:
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
        size = raw.get("hidden_size") or (raw.get("text_config") or {}).get("hidden_size")
        return int(size) if size else None

    if model == "smollm2":
        return SMOLLM2_HIDDEN
    if model.startswith("random:"):
        name = model[len("random:"):]
        if name.endswith(".json"):
            return from_json(name)
        from dflash_model.target.load import PRESETS  # imports torch: only for random: targets

        return PRESETS.get(name, {}).get("hidden_size")
    if os.path.isdir(model):
        return from_json(os.path.join(model, "config.json"))
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # not a repo id, no hub client: unknown
        return None
    return from_json(cached) if isinstance(cached, str) else None


def measure(extract_cfg: Any, train_cfg: Any, tokens: int, device: str, rows: int = 3,
            log: Callable[[str], None] = print) -> Measured:
    """Time ``rows`` target forwards and ``rows`` drafter steps (each after one warm-up) of
    ``tokens``-token rows on ``device``."""
    import torch

    from dflash_core import StageContext
    from dflash_model.fast.settings import compile_wanted
    from dflash_model.fast import compile_cache
    from dflash_model.target.packed_attention import resolve_attn_implementation
    from dflash_stages.pack.random_rows import RandomRowsConfig, random_row
    from dflash_model.target.load import load_target
    from dflash_model.target.capture import FeatureCapture, compile_layers, target_header
    from dflash_stages.train.trainer import Trainer

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    def peak_gib() -> float | None:
        return (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if cuda else None

    # ------------------------------------------------------------ the target (extract's path)
    attn = resolve_attn_implementation(extract_cfg.attn_implementation, dev)
    log(f"loading target {extract_cfg.model} on {device} (attention {attn})")
    t0 = time.perf_counter()
    model, tok = load_target(extract_cfg.model, str(dev), extract_cfg.dtype, attn)
    load_s = time.perf_counter() - t0
    if compile_wanted(extract_cfg.compile, dev):
        compile_layers(model)
    n_layers = model.config.num_hidden_layers
    ids = extract_cfg.layer_ids(n_layers)
    capture = FeatureCapture(model, ids, last_hidden=extract_cfg.last_hidden)
    vocab = min(int(model.config.vocab_size) - 1, len(tok))  # real ids: never the drafter's mask row
    rcfg = RandomRowsConfig(rows=rows + 1, tokens_per_row=tokens, vocab_size=vocab)
    batch = [random_row(rcfg, i) for i in range(rows + 1)]

    def forward(row: dict[str, Any]) -> dict[str, Any]:
        feats, last = capture.capture_row(row)
        return dict(row, features=feats, last_hidden=last)

    warm_t = timed(lambda: forward(batch[0]))
    log(f"target warm-up forward: {warm_t:.2f} s")
    fwd = [timed(lambda r=r: forward(r)) for r in batch[1:]]
    target_s = statistics.median(fwd)
    target_gib = peak_gib()
    log(f"target forward: {target_s * 1e3:.1f} ms per {tokens:,}-token row (median of {rows})")

    # the drafter alone: keep one feature row and the verifier weights (on the CPU, ties kept)
    featured = forward(batch[0])
    hidden = int(model.config.hidden_size)
    feature_rows = int(featured["features"].shape[-1]) // hidden + (featured["last_hidden"] is not None)
    header = target_header(extract_cfg.model, model, ids, tok)
    embed, head = header["embed_weight"], header["lm_head_weight"]
    tied = head is embed or head.data_ptr() == embed.data_ptr()
    header["embed_weight"] = embed.detach().to("cpu", copy=True)
    header["lm_head_weight"] = header["embed_weight"] if tied else head.detach().to("cpu", copy=True)
    model = capture = embed = head = None  # free the target (forward() is not called again)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    gpu_gib = torch.cuda.get_device_properties(dev).total_memory / 2**30 if cuda else None

    # ------------------------------------------------------------ the drafter (train's Trainer)
    saved = None
    with tempfile.TemporaryDirectory(prefix="dflash-plan-") as work:
        ctx = StageContext(stage="train", config=train_cfg, device=str(dev), run_dir=work, work_dir=work)
        trainer = Trainer(train_cfg, ctx)
        trainer.setup(header)
        per_step = int(train_cfg.rows_per_step)

        def step() -> None:
            for micro in range(per_step):
                trainer._forward_backward(featured, micro)
            trainer._optimizer_step(None)
            trainer.step += 1

        log("drafter warm-up step" + (" (compiles: minutes cold, seconds from a compile cache)"
                                      if trainer.compiled else ""))
        first = timed(step)
        log(f"drafter warm-up step: {first:.2f} s")
        if trainer.cache_url:  # as the trainer does after its first step: the real run starts warm
            if compile_cache.save(trainer.cache_url, ctx.logger):
                saved = trainer.cache_url
        steps = [timed(step) for _ in range(rows)]
        step_s = statistics.median(steps)
        drafter_gib = peak_gib()
        drafter_params = sum(p.numel() for p in trainer.model.parameters())
        compiled = bool(trainer.compiled)
        if trainer.tb is not None:
            trainer.tb.close()
        trainer = None
    log(f"drafter step: {step_s * 1e3:.1f} ms per {per_step} x {tokens:,}-token row(s) (median of {rows})")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return Measured(device=str(dev), tokens=tokens, rows=rows, attn=attn, layers=ids, target_load_s=load_s,
                    target_warmup_s=warm_t, target_ms=target_s * 1e3, target_tok_s=tokens / target_s,
                    target_gib=target_gib, drafter_warmup_s=first, drafter_ms=step_s * 1e3,
                    drafter_tok_s=per_step * tokens / step_s, drafter_gib=drafter_gib, compiled=compiled,
                    hidden_size=hidden, feature_rows=feature_rows, drafter_params=drafter_params,
                    gpu_gib=gpu_gib, compile_cache_saved=saved)
