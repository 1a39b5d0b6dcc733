"""The one-GPU rates ``dflash-pipe plan`` predicts from: a short timing of the pipeline's own target
forward and drafter step on one device.

The target is loaded and run as the extract stage runs it (``ExtractConfig.load_target``: the
stage's attention, layer ids, compile and hooks; ``FeatureCapture.capture_row`` per row); the drafter
step is the train stage's ``Trainer`` (``setup``, ``train_step``), on random packed rows
(``random_row``) of the pipeline's row length. The
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

from dflash_core.devices import use_device

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

    clock = _Clock(device)
    dev = clock.dev
    target, featured, header = _time_target(extract_cfg, tokens, rows, clock, log)
    clock.free()  # the target is gone: the drafter's peak is its own
    gpu_gib = torch.cuda.get_device_properties(dev).total_memory / 2**30 if clock.cuda else None
    drafter = _time_drafter(train_cfg, header, featured, tokens, rows, clock, log)
    clock.free()
    return Measured(device=str(dev), tokens=tokens, rows=rows, gpu_gib=gpu_gib, **target, **drafter)


class _Clock:
    """Wall-clock timing on one device (synchronised around each call on CUDA) and the peak
    memory since the last :meth:`free`, above what the device held when the clock was made."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.dev = torch, use_device(device)
        self.cuda = self.dev.type == "cuda"
        self.free()
        # what others hold on the device is not ours; what we keep across a free (the feature row
        # the drafter trains on) counts in the later peak, as it would on a drafter's GPU
        self.base = torch.cuda.memory_allocated(self.dev) if self.cuda else 0

    def free(self) -> None:
        """Collect what the caller dropped, and count the peak from here."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.dev)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def timed(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def peak_gib(self) -> float | None:
        return (self.torch.cuda.max_memory_allocated(self.dev) - self.base) / 2**30 if self.cuda else None


def _time_target(extract_cfg: Any, tokens: int, rows: int, clock: _Clock, log: Callable[[str], None]
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The target as extract runs it (``ExtractConfig.load_target``), timed on random packed rows:
    (its ``Measured`` fields, one row with its features, the target header with the verifier
    weights copied to the CPU). The caller's references are the last to the target."""
    from dflash_core.rows import feature_row
    from dflash_stages.pack.random_rows import RandomRowsConfig, random_row

    log(f"loading target {extract_cfg.model} on {clock.dev}")
    target = extract_cfg.load_target(str(clock.dev))
    log(f"target loaded (attention {target.attn})")
    # real ids: never the drafter's mask row
    vocab = min(int(target.model.config.vocab_size) - 1, len(target.tokenizer))
    rcfg = RandomRowsConfig(rows=rows + 1, tokens_per_row=tokens, vocab_size=vocab)
    batch = [random_row(rcfg, i) for i in range(rows + 1)]

    def forward(row: dict[str, Any]) -> dict[str, Any]:
        feats, last = target.capture.capture_row(row)
        return feature_row(row, feats, last)

    warm_t = clock.timed(lambda: forward(batch[0]))
    log(f"target warm-up forward: {warm_t:.2f} s")
    target_s = statistics.median(clock.timed(lambda r=r: forward(r)) for r in batch[1:])
    target_gib = clock.peak_gib()
    log(f"target forward: {target_s * 1e3:.1f} ms per {tokens:,}-token row (median of {rows})")
    featured = forward(batch[0])
    hidden = int(target.model.config.hidden_size)
    feature_rows = int(featured["features"].shape[-1]) // hidden + (featured["last_hidden"] is not None)
    fields = dict(attn=target.attn, layers=target.layer_ids, target_load_s=target.load_s,
                  target_warmup_s=warm_t, target_ms=target_s * 1e3, target_tok_s=tokens / target_s,
                  target_gib=target_gib, hidden_size=hidden, feature_rows=feature_rows)
    return fields, featured, _header_on_cpu(target.header())


def _header_on_cpu(header: dict[str, Any]) -> dict[str, Any]:
    """The target header with its embedding and LM head copied to the CPU (still one tensor when
    the target ties them), so that the target can be freed before the drafter is built."""
    from dflash_model.target.capture import tied

    embed, head = header["embed_weight"], header["lm_head_weight"]
    cpu_embed = embed.detach().to("cpu", copy=True)
    return dict(header, embed_weight=cpu_embed,
                lm_head_weight=cpu_embed if tied(embed, head) else head.detach().to("cpu", copy=True))


def _time_drafter(train_cfg: Any, header: dict[str, Any], featured: dict[str, Any], tokens: int,
                  rows: int, clock: _Clock, log: Callable[[str], None]) -> dict[str, Any]:
    """The train stage's ``Trainer`` (``setup``, ``train_step``) timed on ``featured`` as every
    row of the step: its ``Measured`` fields. Saves the compile cache after the first step, as
    training does, so the real run starts warm."""
    from dflash_core import StageContext
    from dflash_stages.train.trainer import Trainer

    per_step, steps = int(train_cfg.rows_per_step), int(train_cfg.steps_per_row)
    with tempfile.TemporaryDirectory(prefix="dflash-plan-") as work:
        ctx = StageContext(stage="train", config=train_cfg, device=str(clock.dev), run_dir=work, work_dir=work)
        trainer = Trainer(train_cfg, ctx)
        trainer.setup(header)

        def step() -> None:
            trainer.train_step([featured] * per_step)

        log("drafter warm-up step" + (" (compiles: minutes cold, seconds from a compile cache)"
                                      if trainer.compiled else ""))
        first = clock.timed(step)
        log(f"drafter warm-up step: {first:.2f} s")
        saved = trainer.save_compile_cache()
        step_s = statistics.median(clock.timed(step) for _ in range(rows))
        row_s = step_s * steps  # the drafter's time on one row's features
        fields = dict(drafter_warmup_s=first, drafter_ms=step_s * 1e3, drafter_tok_s=per_step * tokens / row_s,
                      drafter_gib=clock.peak_gib(), compiled=bool(trainer.compiled),
                      drafter_params=sum(p.numel() for p in trainer.model.parameters()),
                      compile_cache_saved=saved)
        trainer.metrics.close()
    log(f"drafter step: {step_s * 1e3:.1f} ms per {per_step} x {tokens:,}-token row(s) (median of {rows})"
        + (f", {steps} steps a row" if steps > 1 else ""))
    return fields
