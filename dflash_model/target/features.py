"""The frozen target made ready to give features: loaded, its decoder layers compiled when wanted,
its feature layers hooked. One recipe for everyone who reads features from packed rows: the
extract stage, ``dflash-pipe plan``'s measurement and the benchmarks, so what they time is what
extract runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_core.devices import use_device
from dflash_model.fast.regional import compile_blocks
from dflash_model.fast.settings import compile_wanted
from dflash_model.target import packed_attention
from dflash_model.target.capture import FeatureCapture, target_header
from dflash_model.target.layers import decoder_layers
from dflash_model.target.linear_attention import document_boundaries, linear_mixers
from dflash_model.target.load import load_target


def feature_layer_ids(layers: str | Sequence[int], num_features: int, n_layers: int) -> list[int]:
    """The target layers to read: for ``auto``, the rule of docs/drafter.md, 'Math' (``num_features`` of the target's
    ``n_layers``), else as given (``FeatureCapture`` checks them)."""
    from dflash_model.drafter import default_target_layer_ids

    if layers == "auto":
        return default_target_layer_ids(n_layers, num_features)
    return [int(t) for t in layers]


@dataclass
class FeatureTarget:
    """A loaded target and the hooks that read its feature layers (see :func:`load_feature_target`)."""

    name: str
    model: nn.Module
    tokenizer: Any
    layer_ids: list[int]
    capture: FeatureCapture
    attn: str
    """The attention implementation it runs (``auto`` resolved)."""
    compiled: bool
    """Its decoder layers go through torch.compile."""
    load_s: float
    """Seconds the load took."""

    def compile_layers(self) -> None:
        """Regional compile of the decoder layers (the hooks stay outside the graphs), and of the
        linear-attention mixers' gated norms: a hybrid's mixer runs outside its layer's graph
        (``linear_attention``), so transformers' torch norm would otherwise run as eight float32
        kernels over every value head (fla's own norm kernel, which transformers takes in some
        versions, is left as it is). On CUDA with fla the mixer runs over whole rows, one shape per
        row length as the layers see, so the norms get static graphs too; otherwise it runs once
        per document, and their graph takes any row count, so that no document length compiles
        inside a row the compile gate already knows."""
        compile_blocks(decoder_layers(self.model))
        norms = [mixer.norm for mixer in linear_mixers(self.model)
                 if isinstance(getattr(mixer, "norm", None), nn.Module)
                 and not type(mixer.norm).__module__.startswith("fla.")]
        if norms:
            boundaries = document_boundaries(self.model)
            whole_rows = boundaries is not None and boundaries.whole_rows and next(self.model.parameters()).is_cuda
            compile_blocks(norms, dynamic=not whole_rows)
        self.compiled = True

    @property
    def compiles_per_length(self) -> bool:
        """Whether a row of a new length may compile: with compiled layers, and with packed_flex,
        whose flex_attention is compiled even when the layers run eager."""
        return self.compiled or self.attn == packed_attention.NAME

    def header(self) -> dict[str, Any]:
        """extract's first item: what the trainer needs of the target (``target_header``)."""
        return target_header(self.name, self.model, self.layer_ids, self.tokenizer)


def load_feature_target(model: str, device: str | torch.device, *, dtype: str = "auto",
                        attn_implementation: str = "auto", layers: str | Sequence[int] = "auto",
                        num_features: int = 5, last_hidden: bool = False,
                        compile: str = "auto") -> FeatureTarget:
    """Load ``model`` frozen on ``device`` (``load_target``; ``cuda``: the current CUDA device),
    compile its decoder layers when ``compile`` (auto | on | off) wants it there, and hook the
    feature layers (``layers``: ids or ``auto``; ``last_hidden``: return the final hidden state too)."""
    dev = use_device(device)
    attn = (packed_attention.resolve_attn_implementation(attn_implementation, dev)
            if attn_implementation == "auto" else attn_implementation)
    t0 = time.perf_counter()
    lm, tokenizer = load_target(model, str(dev), dtype, attn)
    load_s = time.perf_counter() - t0
    ids = feature_layer_ids(layers, num_features, lm.config.num_hidden_layers)
    target = FeatureTarget(name=model, model=lm, tokenizer=tokenizer, layer_ids=ids,
                           capture=FeatureCapture(lm, ids, last_hidden=last_hidden), attn=attn,
                           compiled=False, load_s=load_s)
    if compile_wanted(compile, dev):
        target.compile_layers()
    return target
