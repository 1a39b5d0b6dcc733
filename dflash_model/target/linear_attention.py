"""Document boundaries in the linear-attention (Gated DeltaNet) layers of hybrid targets
(Qwen3.5 / Qwen3.6, transformers ``model_type: qwen3_5``).

Why: a packed row holds several documents, and each must get the features it has alone. The
full-attention layers keep documents apart through the row's document-causal mask, but a Gated
DeltaNet layer takes no mask: its causal conv and its recurrent state run from one document
straight into the next. transformers' own forward does not help (its torch fallbacks ignore
boundaries; with flash-linear-attention bound it passes them to the recurrence only, never to the
conv). So :func:`document_boundaries` replaces the token mixer (``linear_attn``) of every linear
layer, once per model, with one that cuts the row at its documents while
:meth:`DocumentBoundaries.row` is active:

- on CUDA with flash-linear-attention (``pip install .[gpu]``): :func:`varlen_mixer`, one pass over
  the whole row with the layer's own weights and fla's varlen causal conv and chunked gated delta
  rule, both given the row's ``cu_seqlens``;
- otherwise (CPU, or fla missing): the layer's own forward once per document, which is that
  document run alone, exactly.

Outside a row (decoding with a cache, single documents) the layer's own forward runs unchanged.
The replacement is excluded from ``torch.compile``: a compiled decoder layer breaks its graph
around it and keeps its norms and MLP fused, while the mixer runs fla's own Triton kernels.

fla in transformers: ``modeling_qwen3_5`` binds fla's kernels only if ``import fla`` works when it
is first imported, so :func:`bind_fla` imports fla first; ``load_target`` calls it before any
model class is resolved (the layers' own forward, e.g. decoding in evaluate, then runs on fla too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_model.target.layers import decoder_layers

log = logging.getLogger(__name__)

VARLEN_LAYOUT = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias",
                 "norm", "out_proj")
"""The submodules and parameters :func:`varlen_mixer` reads (transformers' Qwen3_5GatedDeltaNet)."""


def bind_fla() -> bool:
    """Import flash-linear-attention when installed, so that transformers binds its kernels when it
    first imports a hybrid model's module; True when fla is importable."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


class Kernels(NamedTuple):
    """The two sequence kernels of a Gated DeltaNet mixer, over one row [1, T, ...] cut at
    ``cu_seqlens`` (int64 [n_docs + 1], the documents' cumulative lengths)."""

    conv: Callable[..., torch.Tensor]
    """(x [1, T, D], weight [D, W], bias [D] | None, activation, cu_seqlens) -> [1, T, D]: the
    causal depthwise conv, restarting at each document."""
    rule: Callable[..., torch.Tensor]
    """(q [1, T, Hk, dk], k, v [1, T, Hv, dv], g [1, T, Hv], beta [1, T, Hv], cu_seqlens) ->
    [1, T, Hv, dv]: the chunked gated delta rule (q and k L2-normed inside, scale dk^-0.5), its
    state zero at each document's start."""


def fla_kernels() -> Kernels | None:
    """flash-linear-attention's varlen kernels, or None when fla is not installed."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None

    def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
             cu_seqlens: torch.Tensor) -> torch.Tensor:
        return causal_conv1d(x=x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens)[0]

    def rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             cu_seqlens: torch.Tensor) -> torch.Tensor:
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu_seqlens)[0]

    return Kernels(conv, rule)


def varlen_mixer(mixer: nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet's token mixer on one packed row x [1, T, H] -> [1, T, H], written from
    its math with both sequence kernels cut at ``cu_seqlens``: qkv projection -> causal conv +
    activation -> split into heads; beta = sigmoid(b), log-decay g = -exp(A_log) * softplus(a +
    dt_bias) -> gated delta rule -> gated RMSNorm with z -> output projection."""
    T = x.shape[1]
    qkv = kernels.conv(mixer.in_proj_qkv(x), mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                       mixer.activation, cu_seqlens)
    q, k, v = qkv.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    beta = mixer.in_proj_b(x).sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(x).float() + mixer.dt_bias)
    out = kernels.rule(q.reshape(1, T, -1, mixer.head_k_dim), k.reshape(1, T, -1, mixer.head_k_dim),
                       v.reshape(1, T, -1, mixer.head_v_dim), g, beta, cu_seqlens)
    z = mixer.in_proj_z(x).reshape(-1, mixer.head_v_dim)
    out = mixer.norm(out.reshape(-1, mixer.head_v_dim), z)
    return mixer.out_proj(out.reshape(1, T, -1))


def varlen_layout(mixer: nn.Module) -> bool:
    """Whether ``mixer`` has what :func:`varlen_mixer` reads (:data:`VARLEN_LAYOUT`)."""
    return all(hasattr(mixer, name) for name in VARLEN_LAYOUT)


def linear_mixers(model: nn.Module) -> list[nn.Module]:
    """The token mixers (``linear_attn``) of the model's linear-attention decoder layers."""
    return [layer.linear_attn for layer in decoder_layers(model) if hasattr(layer, "linear_attn")]


class DocumentBoundaries:
    """The replaced mixers of one model and the documents of the row being captured."""

    def __init__(self, mixers: Sequence[nn.Module], kernels: Kernels | None) -> None:
        self.kernels = kernels
        self._lengths: list[int] | None = None
        self._cu_seqlens: torch.Tensor | None = None
        self.whole_rows = kernels is not None and all(varlen_layout(mixer) for mixer in mixers)
        """Whether every mixer runs a packed row in one pass on CUDA (:func:`varlen_mixer`),
        rather than once per document."""
        for mixer in mixers:
            mixer.forward = self._replacement(mixer, mixer.forward)

    @contextmanager
    def row(self, doc_lengths: Sequence[int], total: int) -> Iterator[None]:
        """Within: the linear layers cut a [1, total] row at ``doc_lengths``; tokens after the last
        document (padding) form one segment of their own."""
        lengths = [int(n) for n in doc_lengths if int(n) > 0]
        rest = total - sum(lengths)
        if rest < 0:
            raise ValueError(f"documents of {sum(lengths)} tokens do not fit a row of {total}")
        self._lengths = lengths + ([rest] if rest else [])
        try:
            yield
        finally:
            self._lengths = self._cu_seqlens = None

    def _replacement(self, mixer: nn.Module, own: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The mixer's new forward: its own outside a packed row, cut at the documents inside one."""
        varlen = self.kernels is not None and varlen_layout(mixer)

        @torch.compiler.disable
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            lengths = self._lengths
            if lengths is None:
                return own(hidden_states, *args, **kwargs)
            if hidden_states.shape[0] != 1 or hidden_states.shape[1] != sum(lengths):
                raise ValueError(f"a packed row is one sequence of {sum(lengths)} tokens, got "
                                 f"{tuple(hidden_states.shape[:2])}")
            if varlen and hidden_states.is_cuda:
                return varlen_mixer(mixer, hidden_states, self._cu(hidden_states.device), self.kernels)
            kwargs["attention_mask"] = None  # a 2D padding mask would not fit the pieces
            return torch.cat([own(part, *args, **kwargs) for part in hidden_states.split(lengths, dim=1)], dim=1)

        return forward

    def _cu(self, device: torch.device) -> torch.Tensor:
        """The row's cu_seqlens on ``device``, made once per row for all layers."""
        if self._cu_seqlens is None:
            bounds = torch.tensor([0, *self._lengths], dtype=torch.long).cumsum(0)  # type: ignore[misc]
            self._cu_seqlens = bounds.to(device)
        return self._cu_seqlens


def document_boundaries(model: nn.Module) -> DocumentBoundaries | None:
    """The model's :class:`DocumentBoundaries`, installed on first use; None when the model has no
    linear-attention layers (its masks alone keep documents apart)."""
    done = getattr(model, "_document_boundaries", None)
    if done is not None:
        return done
    mixers = linear_mixers(model)
    if not mixers:
        return None
    kernels = fla_kernels()
    if kernels is None and next(model.parameters()).is_cuda:
        log.warning("flash-linear-attention is not installed (pip install .[gpu]): the linear-attention "
                    "layers run transformers' torch code once per document, exact but slow")
    boundaries = DocumentBoundaries(mixers, kernels)
    model._document_boundaries = boundaries
    return boundaries
