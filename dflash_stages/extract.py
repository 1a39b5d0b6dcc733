"""extract:hf_hooks — the target's hidden states for each packed row, computed on the fly.

The target runs frozen, without its LM head (the forward stops after the highest layer the
drafter reads), with a block-diagonal causal mask so the documents of a packed row never see
each other: a 4D additive mask for sdpa / eager, a document-causal flex BlockMask for
``packed_flex`` (the default on CUDA: SDPA with a 4D mask leaves its flash kernel, flex skips the
masked blocks; see ``dflash_model.target.packed_attention``). Running in its own thread (or process),
it computes row i+1 while the trainer works on row i; on CUDA it uses its own stream and finishes
each row before handing it on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_core import Stage, StageContext
from dflash_core.facts import ROW_TOKENS
from dflash_core.rows import FEATURE_ROW, PACKED_ROW, checked, feature_row
from dflash_model.fast.compile_gate import GATE
from dflash_model.fast.settings import (AttnImplementation, CompileSetting, DtypeName, WarmUpSetting,
                                        check_switch, peak_gib, warm_up_wanted)


@dataclass
class ExtractConfig:
    model: str = field(metadata={"help": "HF model path or hub name, or 'smollm2' (bundled)"})
    layers: Literal["auto"] | list[int] = field(default="auto", metadata={
        "help": "target layer ids (0-based decoder layer outputs), or auto: num_features ids spread "
                "over the target's layers (docs/drafter.md, 'Math')"})
    num_features: int = field(default=5, metadata={"help": "k layers for layers: auto"})
    dtype: DtypeName = field(default="auto", metadata={"help": "auto = bf16 on CUDA, float32 on CPU"})
    last_hidden: bool = field(default=False, metadata={
        "help": "also return the final hidden state (target_argmax / kl losses)"})
    attn_implementation: AttnImplementation = field(default="auto", metadata={
        "help": "auto = packed_flex on CUDA (flex_attention, document-causal BlockMask), sdpa "
                "elsewhere; or sdpa / eager (4D mask) / packed_flex"})
    compile: CompileSetting = field(default="auto", metadata={
        "help": "torch.compile the target's decoder layers (fused norms, RoPE, SwiGLU): auto (on "
                "CUDA) | on | off"})
    warm_up: WarmUpSetting = field(default="auto", metadata={
        "help": "when every row has one length (pack pads rows to tokens_per_row), run one forward on "
                "random tokens of that length before the first row, so that its compile overlaps the "
                "stages upstream: auto (where the forward compiles) | on | off"})

    def load_target(self, device: str) -> Any:
        """The target loaded, compiled and hooked as this config says (a ``FeatureTarget``)."""
        from dflash_model.target.features import load_feature_target

        return load_feature_target(self.model, device, dtype=self.dtype,
                                   attn_implementation=self.attn_implementation, layers=self.layers,
                                   num_features=self.num_features, last_hidden=self.last_hidden,
                                   compile=self.compile)

    def __post_init__(self) -> None:
        from dflash_model.target.packed_attention import IMPLEMENTATIONS

        check_switch("compile", self.compile)
        check_switch("warm_up", self.warm_up)
        if self.attn_implementation not in IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                             f"got {self.attn_implementation!r}")


class HFHooksExtract(Stage):
    kind = "extract"
    name = "hf_hooks"
    preload = ("transformers:AutoTokenizer", "transformers:AutoModelForCausalLM")
    Config = ExtractConfig
    inputs = {"rows": PACKED_ROW}
    output = FEATURE_ROW
    needs_torch = True
    cache_ignore = ("warm_up",)

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        import torch

        cfg = self.config
        device = torch.device(ctx.device)
        target = cfg.load_target(ctx.device)
        capture, ids = target.capture, target.layer_ids
        # a first call at a new length may compile, and must not overlap another stage's compile
        # in this process
        gated = target.compiles_per_length
        ctx.logger.info("target %s: %d layers, features from %s, attention %s%s", cfg.model,
                        target.model.config.num_hidden_layers, ids, target.attn,
                        ", compiled layers" if target.compiled else "")
        header = target.header()
        yield header
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None

        def forward(row: Mapping[str, Any]) -> tuple[Any, Any]:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                with GATE.call(ctx.stage, len(row["input_ids"]), gated):  # a new length may compile
                    out = capture.capture_row(row)
                if stream is not None:
                    stream.synchronize()
            return out

        length = ctx.upstream_facts.get(ROW_TOKENS)
        if length and warm_up_wanted(cfg.warm_up, gated):
            ctx.summary["warm_up_s"] = warm_up(forward, int(length), header, ctx)
        rows = tokens = 0
        busy = 0.0  # seconds in the forwards, which end when their stream is done
        for row in checked(inputs["rows"], PACKED_ROW, ctx.stage, ctx.upstream("rows")):
            t0 = time.perf_counter()
            feats, last = forward(row)
            busy += time.perf_counter() - t0
            T = feats.shape[0]
            rows += 1
            tokens += T
            ctx.progress(1, unit="rows", tokens=T)
            yield feature_row(row, feats, last)
        # a row's forward against the job's time a row says whether the target's forward or a wait
        # (for pack's rows, for train to take the features) sets the pace
        ctx.summary.update(rows=rows, tokens=tokens, layers=ids, peak_gib=peak_gib(device),
                           forward_ms=round(busy / max(rows, 1) * 1e3, 2))
        ctx.logger.info("extract: %d rows, a row's forward %.1f ms", rows, ctx.summary["forward_ms"])


def warm_up(forward: Callable[[Mapping[str, Any]], Any], length: int, header: Mapping[str, Any],
            ctx: StageContext) -> float:
    """Seconds of one ``forward`` on a row of ``length`` random tokens (three documents), made
    before the first row: the compile of that length (and Triton's autotuning) then runs while the
    stages upstream still work, instead of holding up the first row."""
    from dflash_stages.pack.random_rows import warm_up_row

    row = warm_up_row(header, length)
    t0 = time.perf_counter()
    forward(row)
    took = time.perf_counter() - t0
    ctx.logger.info("extract: warmed up for %d-token rows in %.1f s, before the first row", length, took)
    return round(took, 2)
