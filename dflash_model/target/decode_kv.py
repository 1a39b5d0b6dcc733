"""A decode step that reads the KV cache once and writes one column of it, for the generate loop.

Why: on a small target with many rows in flight and long prompts, a decode step's GPU time is
copies of the cache, not attention. Stock transformers (5.17, the H200's) does two per layer:

* grouped-query attention with a padding mask repeats each K/V head for every query head that
  shares it (``repeat_kv``) before SDPA, so the whole cache is copied (3x for SmolLM2's 9 query /
  3 KV heads) and attention then reads the copy;
* :class:`transformers.DynamicLayer` appends the new column with ``torch.cat``, which copies the
  whole cache again.

Here, a step with one query token folds the query heads of a group into SDPA's query-length axis,
so each group attends to its own K/V head as it lies in the cache (:func:`grouped_sdpa`; the
padding mask has one query row and broadcasts over the group), and :class:`RoomyLayer` keeps the
cache in buffers with room to grow, so the new column is written in place. Both compute what the
stock path computes (the same maths; bf16 kernels may round differently). transformers 5.24 folds
the query heads in its own SDPA path already; there ``sdpa_grouped`` changes nothing but the cache.

How it reaches the model: :func:`register` adds ``sdpa_grouped`` to transformers' attention and
mask interfaces (its masks are SDPA's); ``load_target(..., attn_implementation="sdpa_grouped")``
loads a model that uses it. Prompts (more than one query token) go through stock SDPA.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "sdpa_grouped"
"""The attention implementation name, for ``attn_implementation=`` (after :func:`register`)."""

ROOM = 128
"""Columns a buffer is given beyond what it holds: a new buffer (one copy of the cache) every this
many decode steps, instead of one every step."""


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, heads, T, d], k/v [B, kv_heads, S, d] ->
    ([B, T, heads, d], None). With T = 1 and grouped heads, query head ``h`` reads K/V head
    ``h // group`` (transformers' ``repeat_kv`` order) without the K/V being repeated; anything
    else (a per-head mask, a position bias, softcapping, attention sinks) is stock SDPA."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    extras = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))
    if q_len != 1 or heads == kv_heads or per_head_mask or extras:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # the group's heads as query tokens
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(rows, 1, heads, value.shape[-1]), None


def register() -> None:
    """Add ``sdpa_grouped`` to transformers' attention and mask interfaces (idempotent): without its
    mask entry transformers would build no mask at all, and padding would be attended."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class RoomyLayer(DynamicLayer):
    """A :class:`DynamicLayer` whose keys and values are views into buffers with :data:`ROOM`
    spare columns, which ``update`` appends into in place.

    Rows leave and join through :meth:`adopt`, one layer at a time, so the old and the new cache
    never both exist whole. Keys replaced by anyone else (transformers' own cache methods) just
    cause a new buffer at the next update."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None
    _kview: torch.Tensor | None = None  # the keys last handed out: other keys were put there by
                                        # someone else (values are always replaced with them)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        held, new = self.get_seq_length(), key_states.shape[-2]  # 0 before the first update
        # a first update starts the layer through adopt: lazy_initialization's signature differs
        # between transformers 4.57 (keys) and 5.x (keys, values)
        if not self.is_initialized or self.keys is not self._kview or held + new > self._kbuf.shape[-2]:
            self.adopt(self.keys if held else key_states[:, :, :0], self.values if held else value_states[:, :, :0],
                       room=new + ROOM)
        self._kbuf[:, :, held:held + new] = key_states
        self._vbuf[:, :, held:held + new] = value_states
        self._kview = self._kbuf[:, :, :held + new]
        self.keys, self.values = self._kview, self._vbuf[:, :, :held + new]
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, room: int | None = None) -> None:
        """Hold a copy of ``keys``/``values`` [rows, kv_heads, columns, d] in new buffers with
        ``room`` (default :data:`ROOM`) spare columns; the old buffers are let go first."""
        self._kbuf = self._vbuf = self._kview = self.keys = self.values = None
        self.is_initialized, self.dtype, self.device = True, keys.dtype, keys.device
        room = ROOM if room is None else room
        held = keys.shape[-2]
        self._kbuf = keys.new_empty((*keys.shape[:2], held + room, keys.shape[-1]))
        self._vbuf = values.new_empty((*values.shape[:2], held + room, values.shape[-1]))
        self._kbuf[:, :, :held], self._vbuf[:, :, :held] = keys, values
        self._kview = self._kbuf[:, :, :held]
        self.keys, self.values = self._kview, self._vbuf[:, :, :held]

    def reset(self) -> None:
        self._kbuf = self._vbuf = self._kview = None  # let the buffers go with the views
        super().reset()
