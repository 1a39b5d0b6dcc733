"""Rolling the target's cache back to the verified tokens after a speculative verify forward.

A KV layer forgets rejected drafts by cropping. A linear-attention layer (Qwen3.5's Gated DeltaNet,
any layer transformers caches as ``LinearAttentionCacheLayerMixin``) keeps a conv window and a
recurrent state into which the verify forward has already folded every draft, accepted or not; that
state cannot be cropped (transformers refuses), so the decode loop snapshots it before verifying and,
when a draft is rejected, restores the snapshot and re-runs the kept tokens (docs/hybrid_targets.md,
'The Qwen3.6-27B shape').
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

LinearStates = list[list[torch.Tensor]]


@functools.cache
def _linear_layer_classes() -> tuple[type, ...]:
    """The cache-layer classes that hold linear-attention state: none before transformers 5.5,
    which has no ``LinearAttentionCacheLayerMixin`` (``compat`` refuses hybrid targets before 5.14)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:
        return ()
    return (LinearAttentionCacheLayerMixin,)


def linear_state_layers(cache: Any) -> list[Any]:
    """The cache layers that hold linear-attention state; [] for a dense target's cache."""
    from transformers.cache_utils import CacheLayerMixin

    layers = [layer for layer in cache.layers if isinstance(layer, _linear_layer_classes())]
    mixed = sorted({type(layer).__name__ for layer in layers if isinstance(layer, CacheLayerMixin)})
    if mixed:
        # their crop would need the linear half skipped and the KV half kept: not done here
        raise NotImplementedError(f"speculative decoding cannot roll back cache layers that hold KV and linear "
                                  f"state together ({', '.join(mixed)})")
    return layers


def _states(layer: Any) -> list[torch.Tensor]:
    """The layer's conv and recurrent states, and from transformers 5.25 on the count of tokens it
    has folded in (``cumulative_length_linear``), which must roll back with them."""
    count = getattr(layer, "cumulative_length_linear", None)
    return ([t for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None]
            + ([count] if isinstance(count, torch.Tensor) else []))


def snapshot(layers: Sequence[Any]) -> LinearStates:
    """Copies of the conv and recurrent states of ``layers`` (small: no sequence dimension)."""
    return [[t.clone() for t in _states(layer)] for layer in layers]


def restore(layers: Sequence[Any], saved: LinearStates) -> None:
    """Put a :func:`snapshot` back, in place (the cache's tensors keep their addresses)."""
    for layer, tensors in zip(layers, saved, strict=True):
        for live, old in zip(_states(layer), tensors, strict=True):
            live.copy_(old)


def crop(cache: Any, length: int) -> None:
    """Drop the KV entries after the first ``length`` tokens; linear layers are left to
    :func:`restore`. Each KV layer is measured on its own: from transformers 5.25 on, the cache's
    length is its first layer's, a linear one in Qwen3.5, which :func:`restore` has already rewound.
    (A negative crop means "remove n" in every transformers version; 5.24 rejects the older
    absolute form.)"""
    for layer in cache.layers:
        if not isinstance(layer, _linear_layer_classes()):
            extra = int(layer.get_seq_length()) - length
            if extra > 0:
                layer.crop(-extra)
