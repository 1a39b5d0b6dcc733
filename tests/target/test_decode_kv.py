"""decode_kv — grouped-query decode attention without repeated K/V, and a KV layer that appends in
place: both must give what stock transformers gives (eager attention, DynamicLayer)."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_model.target import decode_kv
from tests.transformers_versions import needs_hybrid


def _twins(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random weights twice: eager attention (repeat_kv, written out), and sdpa_grouped."""
    from tests.stages.test_evaluate import tiny_qwen3
    from tests.stages.test_evaluate_hybrid import tiny_qwen3_5

    decode_kv.register()
    make = tiny_qwen3 if kind == "dense" else tiny_qwen3_5
    eager, grouped = make(), make()
    eager.set_attn_implementation("eager")
    grouped.set_attn_implementation(decode_kv.NAME)
    return eager, grouped


@pytest.mark.parametrize("kind", ["dense", pytest.param("hybrid", marks=needs_hybrid)])
def test_decode_steps_equal_eager_attention_on_a_left_padded_batch(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill a left-padded batch, then decode a few tokens: every step's logits equal eager
    attention's on a stock cache (fp32), padding included — so each query head reads its own K/V
    head and the padding mask reaches the grouped path (without its mask entry padded rows would
    differ). Stock SDPA runs for the prompt only."""
    from dflash_model.target.generate import _decode_cache, left_pad
    from dflash_model.target.spec_decode import forward_kwargs, new_cache

    eager, grouped = _twins(kind)
    assert eager.config.num_attention_heads > eager.config.num_key_value_heads  # grouped heads
    rng = random.Random(0)
    ids, mask = left_pad([[rng.randrange(100) for _ in range(n)] for n in (7, 2, 12)], pad_id=0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [new_cache(eager), _decode_cache(grouped)]
    stock: list[int] = []  # query length of each call that went to stock SDPA
    real = decode_kv.sdpa_attention_forward
    monkeypatch.setattr(decode_kv, "sdpa_attention_forward",
                        lambda module, q, *a, **kw: (stock.append(q.shape[2]), real(module, q, *a, **kw))[1])
    with torch.no_grad():
        for step in range(4):
            outs = [model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **{forward_kwargs(model)[0]: cache}).logits[:, -1]
                    for model, cache in zip((eager, grouped), caches)]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
            ids = outs[0].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            pos = pos[:, -1:] + 1
    attention_layers = sum(t != "linear_attention" for t in getattr(eager.config, "layer_types", None)
                           or ["full_attention"] * eager.config.num_hidden_layers)
    assert stock == [12] * attention_layers  # the prompt (12 wide) only: no decode step


def test_roomy_layer_appends_in_place_and_survives_replaced_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys/values always equal the concatenation of what was added; a decode step's column goes
    into the buffer already there until its room runs out; keys replaced from outside, or adopted
    (rows leaving, columns cut), are what the next update appends to."""
    monkeypatch.setattr(decode_kv, "ROOM", 3)
    layer = decode_kv.RoomyLayer()
    g = torch.Generator().manual_seed(0)
    new = lambda n, rows=2: (torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g))
    k, v = new(5)
    layer.update(k, v)
    buffers = [layer._kbuf.data_ptr()]
    for _ in range(4):
        dk, dv = new(1)
        got_k, got_v = layer.update(dk, dv)
        k, v = torch.cat([k, dk], 2), torch.cat([v, dv], 2)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        buffers.append(layer._kbuf.data_ptr())
    assert buffers[:4] == [buffers[0]] * 4 and buffers[4] != buffers[0]  # room for 3 columns, then a new buffer

    layer.keys, layer.values = layer.keys[[1], :, 2:], layer.values[[1], :, 2:]  # one row left, 2 columns cut
    k, v = k[[1], :, 2:], v[[1], :, 2:]
    dk, dv = new(1, rows=1)
    got_k, got_v = layer.update(dk, dv)
    assert torch.equal(got_k, torch.cat([k, dk], 2)) and torch.equal(got_v, torch.cat([v, dv], 2))
    assert layer.get_seq_length() == 8  # 5 + 4, 2 cut, 1 more

    k, v = torch.cat([k, dk], 2)[[0, 0]], torch.cat([v, dv], 2)[[0, 0]]  # the row twice: rows joined
    layer.adopt(k, v)
    adopted = layer._kbuf.data_ptr()
    dk, dv = new(1)
    got_k, got_v = layer.update(dk, dv)
    assert torch.equal(got_k, torch.cat([k, dk], 2)) and torch.equal(got_v, torch.cat([v, dv], 2))
    assert layer._kbuf.data_ptr() == adopted  # adopted with room: the step wrote in place

    fresh = decode_kv.RoomyLayer()  # adopting is a start of its own: the next update appends to it
    fresh.adopt(k, v)
    got_k, got_v = fresh.update(dk, dv)
    assert torch.equal(got_k, torch.cat([k, dk], 2)) and torch.equal(got_v, torch.cat([v, dv], 2))
