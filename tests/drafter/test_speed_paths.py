"""The training step's speed paths compute exactly what the plain path computes.

Padding anchors to a fixed count, splitting the LM-head loss into equal chunks and compiling the
draft layers / loss chunks (what CUDA runs) must not change the loss, the gradients or the
metrics; and the compiled layers must not recompile when the anchors or documents change.
"""

import logging

import pytest
import torch
from conftest import make_drafter, packed_row

from dflash_model.drafter import FeatureBatch, drafter_loss, sample_anchors
from dflash_model.drafter.loss import _hard_chunk, _soft_chunk


def _loss(model, r, anchors, target_hidden=None, **kw):
    batch = FeatureBatch(r["features"], r["input_ids"], r["loss_mask"], r["position_ids"], r["doc_lengths"],
                         target_hidden=target_hidden)
    return drafter_loss(model, batch, anchors, r["E"], r["W"], **kw)


def _step(model, r, anchors, **kw):
    out = _loss(model, r, anchors, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("target", ["data", "kl"])
def test_padding_blocks_change_nothing(target):
    r = packed_row(3)
    model = make_drafter()
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], 7, torch.Generator().manual_seed(1))
    kw = {"target": target, "target_hidden": torch.randn(r["features"].shape[0], 32, dtype=torch.float64)}
    plain, g_plain = _step(model, r, anchors, **kw)
    padded, g_padded = _step(model, r, anchors, pad_anchors_to=16, **kw)
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-12, atol=0)
    for n in g_plain:
        torch.testing.assert_close(g_padded[n], g_plain[n], rtol=1e-10, atol=1e-14, msg=n)
    assert padded.n_blocks == plain.n_blocks == 7
    assert int(padded.n_supervised) == int(plain.n_supervised)
    assert torch.equal(padded.per_slot_correct, plain.per_slot_correct)
    assert torch.equal(padded.per_slot_count, plain.per_slot_count)
    assert float(padded.tau_sim) == float(plain.tau_sim)


def test_equal_chunks_with_zero_rows_equal_one_chunk():
    """7 rows in chunks of 3 -> 3 chunks of 3 with 2 zero rows; loss, argmax and grad unchanged."""
    from dflash_model.drafter.loss import ChunkedLMHeadLoss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 16, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(40, 16, dtype=torch.float64, generator=g)
    coef = torch.rand(7, dtype=torch.float64, generator=g)
    y = torch.randint(0, 40, (7,), generator=g)
    outs = []
    for chunk in (3, 100):
        loss, pred, tgt = ChunkedLMHeadLoss.apply(h, W, coef, y, None, chunk, False)
        (grad,) = torch.autograd.grad(loss, h)
        outs.append((loss, pred, tgt, grad))
    ref = (-(coef * (h @ W.T).log_softmax(-1).gather(1, y[:, None]).squeeze(1)).sum())
    (ref_grad,) = torch.autograd.grad(ref, h)
    for loss, pred, tgt, grad in outs:
        assert pred.shape == (7,) and tgt.shape == (7,)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
        assert torch.equal(pred, (h @ W.T).argmax(-1)) and torch.equal(tgt, y)


def test_compiled_chunk_functions_equal_eager():
    """The loss chunks CUDA runs compiled; Inductor on the CPU compiles the same graph."""
    g = torch.Generator().manual_seed(0)
    h, soft = torch.randn(2, 12, 16, generator=g)
    W = torch.randn(50, 16, generator=g)
    coef, y = torch.rand(12, generator=g), torch.randint(0, 50, (12,), generator=g)
    for fn, other in ((_hard_chunk, y), (_soft_chunk, soft)):
        eager = fn(h, W, coef, other)
        compiled = torch.compile(fn, dynamic=False)(h, W, coef, other)
        for a, b in zip(compiled, eager):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(a, b)


def test_compiled_layers_equal_eager_and_do_not_recompile():
    """Regional compilation: two attention graphs (the first layer reads the frozen embedding's
    distinct rows), one MLP graph for both row counts (all 32 block rows; the last layer's 24 of
    slots 1..B-1) and one for the two norms outside the layers (40 context rows, 24 output rows),
    whatever the anchors and documents of the row."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = make_drafter(num_layers=3, dtype=torch.float32, attn_backend="sdpa")
    compiled = make_drafter(num_layers=3, dtype=torch.float32, attn_backend="sdpa")
    compiled.compile_layers()
    for step, (seed, docs, n) in enumerate([(0, (12, 9, 14), 5), (1, (20, 15), 7), (2, (35,), 3)]):
        r = packed_row(seed, doc_lengths=docs, dtype=torch.float32)
        anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], n, torch.Generator().manual_seed(step))
        a, ga = _step(eager, r, anchors, pad_anchors_to=8)
        b, gb = _step(compiled, r, anchors, pad_anchors_to=8)
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=name)
        assert float(a.tau_sim) == float(b.tau_sim)
    assert counters["stats"]["unique_graphs"] == 4


def test_compile_cache_round_trip(tmp_path):
    from dflash_model.fast import compile_cache

    log = logging.getLogger("test")
    url = compile_cache.cache_url(str(tmp_path), torch.device("cpu"))
    assert url.startswith(str(tmp_path)) and url.endswith(".bin")
    assert not compile_cache.load(url, log)  # nothing there yet: a cold start, not an error
    torch.compile(lambda x: (x * 2).sin())(torch.randn(4))
    assert compile_cache.save(url, log)
    assert (tmp_path / url.rsplit("/", 1)[1]).stat().st_size > 0
    assert compile_cache.load(url, log)
    (tmp_path / "junk.bin").write_bytes(b"not a cache")
    assert not compile_cache.load(str(tmp_path / "junk.bin"), log)  # damaged: warned, never fatal


def test_flex_kernel_options_resolution():
    """auto -> the table's options only for a GPU it knows (none on CPU); a mapping is used as
    given (copied); null/{} -> torch's defaults; the train param refuses other strings."""
    from dflash_model.fast.flex import TUNED_FLEX_OPTIONS, choose_kernel_options
    from dflash_stages.train.config import TrainConfig

    cpu = torch.device("cpu")
    assert choose_kernel_options("auto", cpu, 128, torch.bfloat16) is None
    given = {"bwd_num_warps": 4}
    got = choose_kernel_options(given, cpu, 128, torch.bfloat16)
    assert got == given and got is not given
    assert choose_kernel_options(None, cpu, 128, torch.bfloat16) is None
    assert choose_kernel_options({}, cpu, 128, torch.bfloat16) is None
    h200 = TUNED_FLEX_OPTIONS[((9, 0), 128, torch.bfloat16)]
    assert h200["bwd_BLOCK_N1"] % h200["bwd_BLOCK_M1"] == 0 and h200["bwd_BLOCK_M2"] % h200["bwd_BLOCK_N2"] == 0
    assert all(128 % h200[k] == 0 for k in h200 if "BLOCK" in k)  # divide the BlockMask's 128 tiles
    with pytest.raises(ValueError, match="flex_kernel_options must be auto, null or a mapping"):
        TrainConfig(flex_kernel_options="fast")
