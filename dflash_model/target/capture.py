"""The target's decoder layers, found by shape, and the outputs of chosen layers captured by hooks.

Shared by the extract stage (training features) and the evaluate stage (features of verified
tokens during speculative decoding), so both read exactly the same hidden states. The ±1 layer-id
convention is decided here once: id t = output of decoder layer t (0-based) = HF
``hidden_states[t + 1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from torch import nn

from dflash_core.rows import KIND, TARGET_KIND
from dflash_model.drafter.layers import validate_target_layer_ids
from dflash_model.target.layers import base_model, decoder_layers

T = TypeVar("T")


def embeddings_and_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen verifier weights the drafter needs: input embedding and LM head [V, H]
    (the same tensor when the target ties them)."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def tied(embed: torch.Tensor, head: torch.Tensor) -> bool:
    """Whether the target ties its LM head to its embedding: copies of the two must stay one tensor."""
    return head is embed or head.data_ptr() == embed.data_ptr()


def target_header(name: str, model: nn.Module, layer_ids: Sequence[int], tokenizer: Any) -> dict[str, Any]:
    """The first item of extract's stream: what the trainer needs of the target (its config, the
    layers read, the frozen embedding and LM head, the tokenizer's size and special ids)."""
    embed, head = embeddings_and_head(model)
    return {KIND: TARGET_KIND, "model": name, "config": model.config.to_dict(),
            "target_layer_ids": list(layer_ids), "embed_weight": embed, "lm_head_weight": head,
            "tokenizer_len": len(tokenizer), "all_special_ids": list(getattr(tokenizer, "all_special_ids", []))}


class _Enough(Exception):
    """Raised by the last hook needed, so layers above it (and the LM head) never run."""


class FeatureCapture:
    """Forward hooks on the chosen decoder layers; ``capture`` returns [.., T, k*H].

    With ``last_hidden`` the final-normed last hidden state is returned too (needed only by
    the ``target_argmax``/``kl`` losses); otherwise the forward stops after the highest
    chosen layer. In hybrid targets the linear-attention layers are cut at each packed row's
    documents (``dflash_model.target.linear_attention``).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], last_hidden: bool = False) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self.layer_ids = validate_target_layer_ids(layer_ids, len(self.layers))
        self.last_hidden = last_hidden
        self._out: dict[int, torch.Tensor] = {}
        from dflash_model.target.linear_attention import document_boundaries

        self._documents = document_boundaries(model)

    @contextmanager
    def _hooks(self, stop_early: bool) -> Iterator[None]:
        top = max(self.layer_ids)
        handles = []
        for t in set(self.layer_ids):
            def hook(_m: nn.Module, _i: Any, out: Any, t: int = t) -> None:
                self._out[t] = out[0] if isinstance(out, (tuple, list)) else out
                if t == top and stop_early:
                    raise _Enough()
            handles.append(self.layers[t].register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **kw: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features [B, T, k*H], last hidden [B, T, H] or None) for a batch of ids."""
        self._out.clear()
        last = None
        with self._hooks(stop_early=not self.last_hidden):
            try:
                out = base_model(self.model)(input_ids=input_ids, position_ids=position_ids,
                                             attention_mask=attention_mask, use_cache=False, **kw)
                last = out[0] if self.last_hidden else None
            except _Enough:
                pass
        return self._take(), last

    def capture_row(self, row: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """extract's per-row work: (features [T, k*H], last hidden [T, H] or None) of one packed
        row (``input_ids``, ``position_ids``, ``doc_lengths``), with the row's mask for the model's
        attention implementation (4D additive or flex BlockMasks), on the model's device."""
        from dflash_model.target.packed_attention import row_attention_mask

        p = next(self.model.parameters())
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        pos = torch.as_tensor(row["position_ids"], dtype=torch.long)
        lengths = [int(n) for n in row["doc_lengths"]]
        mask = row_attention_mask(self.model, lengths, ids.shape[0], p.dtype, p.device)
        with self._documents.row(lengths, ids.shape[0]) if self._documents else nullcontext():
            feats, last = self.capture(ids.to(p.device)[None], pos.to(p.device)[None], mask)
        return feats[0], None if last is None else last[0]

    @torch.no_grad()
    def record(self, forward: Callable[[], T]) -> tuple[T, torch.Tensor]:
        """Run any forward of the model (the full LM with a KV cache, say) with the hooks on,
        to the end; return its result and the chosen layers' features [B, T, k*H] — the
        features of exactly the forward whose logits the caller uses."""
        self._out.clear()
        with self._hooks(stop_early=False):
            result = forward()
        return result, self._take()

    def _take(self) -> torch.Tensor:
        feats = torch.cat([self._out[t] for t in self.layer_ids], dim=-1)
        self._out.clear()
        return feats
