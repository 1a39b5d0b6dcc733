"""Tiny, fast fixtures for the drafter tests (real transformers configs, small dims, CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # reference.py

VOCAB, HIDDEN, MASK_ID = 64, 32, 63


def qwen3_config(**kw):
    import transformers

    base = dict(hidden_size=HIDDEN, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_hidden_layers=8, vocab_size=VOCAB, max_position_embeddings=512)
    base.update(kw)
    return transformers.Qwen3Config(**base)


def packed_row(seed: int = 0, doc_lengths=(12, 9, 14), pad: int = 5, k: int = 2, dtype=torch.float64):
    """One packed row: documents back to back, per-document positions, prompt tokens unsupervised."""
    g = torch.Generator().manual_seed(seed)
    T = sum(doc_lengths) + pad
    input_ids = torch.randint(0, VOCAB - 1, (T,), generator=g)
    loss_mask = torch.zeros(T, dtype=torch.long)
    position_ids = torch.zeros(T, dtype=torch.long)
    start = 0
    for n in doc_lengths:
        position_ids[start:start + n] = torch.arange(n)
        loss_mask[start + 3:start + n] = 1  # 3 prompt tokens per document
        start += n
    loss_mask[start - 5] = 0  # a hole inside the last document's completion
    return dict(input_ids=input_ids, loss_mask=loss_mask, position_ids=position_ids, doc_lengths=list(doc_lengths),
                features=torch.randn(T, k * HIDDEN, generator=g, dtype=dtype),
                E=torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype),
                W=torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype) * 0.3)


def make_drafter(num_layers: int = 2, block_size: int = 4, dtype=torch.float64, **kw):
    from dflash_model.drafter import DFlashDrafter

    torch.manual_seed(0)
    cfg_kw = kw.pop("config_kw", {})
    m = DFlashDrafter(qwen3_config(**cfg_kw), num_layers=num_layers, block_size=block_size,
                      mask_token_id=MASK_ID, target_layer_ids=kw.pop("target_layer_ids", [1, 5]), **kw)
    m.reset_parameters(std=0.3)  # large enough that attention is far from uniform
    return m.to(dtype)


@pytest.fixture
def row():
    return packed_row()
