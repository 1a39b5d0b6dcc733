import pytest
import torch
from conftest import MASK_ID, make_drafter, packed_row
from reference import reference_block_logits, reference_loss

from dflash_model.drafter import FeatureBatch, build_blocks, doc_ids_from_lengths, drafter_loss, sample_anchors

SLIDING = dict(layer_types=["full_attention", "sliding_attention"],
               config_kw=dict(use_sliding_window=True, sliding_window=3))


def _setup(seed=0, n=6, **kw):
    r = packed_row(seed)
    model = make_drafter(**kw)
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], n, torch.Generator().manual_seed(seed))
    docs = doc_ids_from_lengths(r["doc_lengths"], 40)
    return r, model, anchors, docs


def _loss(model, r, anchors, target_hidden=None, **kw):
    batch = FeatureBatch(r["features"], r["input_ids"], r["loss_mask"], r["position_ids"], r["doc_lengths"],
                         target_hidden=target_hidden)
    return drafter_loss(model, batch, anchors, r["E"], r["W"], **kw)


def _grads(model):
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("kw", [{}, SLIDING], ids=["full", "sliding"])
def test_model_matches_float64_reference_logits_loss_and_grads(kw):
    r, model, anchors, docs = _setup(**kw)
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, MASK_ID)
    ref_loss, ref_logits = reference_loss(model, r["features"], r["input_ids"], r["loss_mask"], r["position_ids"],
                                          docs, anchors, r["E"], r["W"], gamma=3.0)
    ref_loss.backward()
    ref_g = _grads(model)
    hidden = model(r["features"], ids, r["position_ids"], pos, layout, r["E"])
    torch.testing.assert_close(hidden @ r["W"].T, ref_logits, rtol=1e-5, atol=1e-9)
    out = _loss(model, r, anchors, gamma=3.0, chunk_rows=5)
    out.loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, ref_g[n], rtol=1e-5, atol=1e-9, msg=n)


def test_chunked_loss_equals_unchunked_loss_and_grads():
    r, model, anchors, _ = _setup(n=12)
    results = []
    for chunk in (1, 7, 10**6):
        out = _loss(model, r, anchors, chunk_rows=chunk)
        out.loss.backward()
        results.append((out.loss.detach(), _grads(model), out.tau_sim, out.per_slot_correct))
    for loss, g, tau, pc in results[:-1]:
        torch.testing.assert_close(loss, results[-1][0], rtol=1e-12, atol=0)
        assert tau == results[-1][2] and torch.equal(pc, results[-1][3])
        for n in g:
            torch.testing.assert_close(g[n], results[-1][1][n], rtol=1e-10, atol=1e-14)


def test_metrics_match_explicit_count():
    r, model, anchors, docs = _setup(n=12)
    out = _loss(model, r, anchors)
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, MASK_ID)
    logits = model(r["features"], ids, r["position_ids"], pos, layout, r["E"]) @ r["W"].T
    pred = logits.argmax(-1)
    correct = torch.zeros(len(anchors), 3, dtype=torch.bool)
    count = torch.zeros(3, dtype=torch.long)
    for n, a in enumerate(anchors.tolist()):
        for k in range(1, 4):
            p = a + k
            if p < 40 and docs[p] == docs[a] and r["loss_mask"][p] == 1:
                count[k - 1] += 1
                correct[n, k - 1] = bool(pred[n, k - 1] == r["input_ids"][p])
    assert torch.equal(out.per_slot_count, count) and torch.equal(out.per_slot_correct, correct.sum(0))
    leading = torch.tensor([next((i for i, c in enumerate(row) if not c), 3) for row in correct.tolist()])
    assert out.tau_sim.item() == pytest.approx((1 + leading).double().mean().item())
    assert out.n_blocks == len(anchors) and out.n_supervised == int(count.sum())


def _target_hidden_and_expected(model, r, anchors, docs, th):
    logits = reference_block_logits(model, r["features"], r["input_ids"], r["position_ids"], docs, anchors,
                                    r["E"], r["W"])
    num_ce = num_kl = den = 0.0
    for n, a in enumerate(anchors.tolist()):
        for k in range(1, 4):
            p = a + k
            if p < 40 and docs[p] == docs[a] and r["loss_mask"][p] == 1:
                w = torch.exp(torch.tensor(-(k - 1) / 3.0, dtype=torch.float64))
                tlogp = torch.log_softmax(th[p - 1] @ r["W"].T, -1)  # the target predicts row p at row p-1
                dlogp = torch.log_softmax(logits[n, k - 1], -1)
                num_ce = num_ce - w * dlogp[tlogp.argmax()]
                num_kl = num_kl + w * (tlogp.exp() * (tlogp - dlogp)).sum()
                den += w
    return num_ce / den, num_kl / den


def test_target_argmax_and_kl_targets_match_reference():
    r, model, anchors, docs = _setup(n=5)
    th = torch.randn(40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ref_ce, ref_kl = _target_hidden_and_expected(model, r, anchors, docs, th)
    (ref_ce + ref_kl).backward()
    ref_g = _grads(model)
    ce = _loss(model, r, anchors, gamma=3.0, target="target_argmax", target_hidden=th, chunk_rows=4)
    kl = _loss(model, r, anchors, gamma=3.0, target="kl", target_hidden=th, chunk_rows=3)
    (ce.loss + kl.loss).backward()
    torch.testing.assert_close(ce.loss, ref_ce, rtol=1e-9, atol=0)
    torch.testing.assert_close(kl.loss, ref_kl, rtol=1e-9, atol=0)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, ref_g[n], rtol=1e-7, atol=1e-12)
    with pytest.raises(ValueError):
        _loss(model, r, anchors, target="kl")


def test_target_argmax_equals_data_loss_when_the_target_predicts_the_data():
    r, model, anchors, _ = _setup(n=10)
    W = torch.eye(64, 32, dtype=torch.float64) * 5  # distinct rows 0..31: argmax(W h) recoverable
    ids = r["input_ids"] % 32
    th = torch.zeros(40, 32, dtype=torch.float64)
    th[:-1] = torch.nn.functional.one_hot(ids[1:], 32).double()  # row p-1 predicts token p
    batch = FeatureBatch(r["features"], ids, r["loss_mask"], r["position_ids"], r["doc_lengths"], target_hidden=th)
    data = drafter_loss(model, batch, anchors, r["E"], W)
    tgt = drafter_loss(model, batch, anchors, r["E"], W, target="target_argmax")
    torch.testing.assert_close(tgt.loss, data.loss, rtol=1e-12, atol=0)


def test_documents_are_isolated_and_use_their_own_positions():
    """A document's blocks give the same hidden states wherever it sits in the pack."""
    r = packed_row(doc_lengths=(12, 9), pad=0)
    model = make_drafter(**SLIDING)
    swap = torch.cat([torch.arange(12, 21), torch.arange(0, 12)])  # [doc1 ; doc0]
    out = []
    for order, lengths, anchors in ((torch.arange(21), [12, 9], torch.tensor([4, 14])),
                                    (swap, [9, 12], torch.tensor([2, 13]))):
        docs = doc_ids_from_lengths(lengths, 21)
        ids, pos, layout = build_blocks(r["input_ids"][order], r["position_ids"][order], docs, anchors, 4, MASK_ID)
        out.append(model(r["features"][order], ids, r["position_ids"][order], pos, layout, r["E"]))
    torch.testing.assert_close(out[0][0], out[1][1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0][1], out[1][0], rtol=1e-12, atol=1e-12)


def test_rope_uses_the_given_positions():
    r, model, anchors, docs = _setup(n=4)
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, MASK_ID)
    base = model(r["features"], ids, r["position_ids"], pos, layout, r["E"])
    shifted = model(r["features"], ids, r["position_ids"] + 7, pos + 7, layout, r["E"])
    torch.testing.assert_close(base, shifted, rtol=1e-9, atol=1e-9)  # RoPE: only relative positions matter
    assert not torch.allclose(base, model(r["features"], ids, r["position_ids"], pos + 1, layout, r["E"]))


def test_bf16_runs_and_tracks_float32():
    r = packed_row(dtype=torch.float32)
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], 8, torch.Generator().manual_seed(0))
    m32 = make_drafter(dtype=torch.float32)
    m16 = make_drafter(dtype=torch.bfloat16)
    l32 = _loss(m32, r, anchors).loss
    r16 = dict(r, features=r["features"].bfloat16(), E=r["E"].bfloat16(), W=r["W"].bfloat16())
    out = _loss(m16, r16, anchors)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and abs(out.loss.item() - l32.item()) < 0.05 * l32.item()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all()
               for p in m16.parameters())


def test_tiny_hf_target_end_to_end_with_tied_embeddings():
    import transformers
    from conftest import qwen3_config

    from dflash_model.drafter import DFlashDrafter

    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(qwen3_config(tie_word_embeddings=True)).eval()
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert emb is head
    r = packed_row(dtype=torch.float32)
    drafter = DFlashDrafter(target.config, num_layers=2, block_size=4, mask_token_id=MASK_ID)
    ids_ = drafter.config.target_layer_ids
    with torch.no_grad():
        hs = target(r["input_ids"][None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[t + 1][0] for t in ids_], -1)  # id t = output of layer t = hidden_states[t+1]
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], 8, torch.Generator().manual_seed(0))
    batch = FeatureBatch(feats, r["input_ids"], r["loss_mask"], r["position_ids"], r["doc_lengths"],
                         target_hidden=hs[-1][0])
    out = drafter_loss(drafter, batch, anchors, emb, head, target="target_argmax")
    out.loss.backward()
    assert emb.grad is None and out.loss.isfinite()
    assert not any("embed" in n or "lm_head" in n for n in drafter.state_dict())
    assert drafter.fc.weight.grad is not None


def test_block_ids_must_hold_the_mask_token_after_slot_0():
    """The first layer computes the mask slots once (expand_blocks): other tokens there are refused."""
    r, model, anchors, docs = _setup()
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, MASK_ID)
    model(r["features"], ids, r["position_ids"], pos, layout, r["E"])
    ids[2, 3] = 5
    with pytest.raises(RuntimeError, match="slots 1..B-1 must hold mask_token_id"):
        model(r["features"], ids, r["position_ids"], pos, layout, r["E"])


@pytest.fixture
def inductor_choices():
    """Restore Inductor's choices factory and this thread's choices after the test."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    saved, handler = config.inductor_choices_class, V.choices
    yield config
    config.inductor_choices_class = saved
    V.set_choices_handler(handler)


def test_flex_tile_choices_cap_the_backward_configs(monkeypatch, inductor_choices):
    """The tile hook's Inductor choices offer torch's flex backward configs with every block
    size cut to the tile: torch's own sm90 list (capability faked, the heuristics are host code)
    becomes one that fits 64-tiles; the calling thread uses them at once; a choices class that is
    not ours is never replaced."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    from dflash_model.fast.flex import _allow_flex_tile, _tile_choices

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    fields = ("block_m1", "block_n1", "block_m2", "block_n2", "num_stages", "num_warps")
    plain = InductorChoices().get_flex_attention_bwd_configs(128, torch.bfloat16, "cuda")
    capped = _tile_choices(64).get_flex_attention_bwd_configs(128, torch.bfloat16, "cuda")
    assert [[getattr(c, f) for f in fields] for c in plain] == [[64, 128, 128, 64, 3, 8]]
    assert [[getattr(c, f) for f in fields] for c in capped] == [[64, 64, 64, 64, 3, 8]]
    assert _tile_choices(8).uuid() == "dflash-flex-tile-8"
    _allow_flex_tile(64)
    _allow_flex_tile(32)  # ours may be replaced by ours
    assert inductor_choices.inductor_choices_class().uuid() == "dflash-flex-tile-32"
    assert V.choices.uuid() == "dflash-flex-tile-32"
    inductor_choices.inductor_choices_class = InductorChoices
    with pytest.raises(RuntimeError, match="flex tile 64: Inductor's choices are already replaced"):
        _allow_flex_tile(64)


def test_flex_tile_choice(monkeypatch, inductor_choices):
    """auto -> 64 on an H200 (bf16, head dim 128) when the kernel options fit it, else 128; 128 on
    CPU and on GPUs not in the table; a given tile is used and checked against the options;
    choosing never touches Inductor; the train param takes auto or a power of two from 16 to 128."""
    from dflash_model.fast.flex import TUNED_FLEX_OPTIONS, choose_tile
    from dflash_stages.train.config import TrainConfig

    bf16, cuda = torch.bfloat16, torch.device("cuda")
    tuned = TUNED_FLEX_OPTIONS[((9, 0), 128, bf16)]
    assert flex_choices_class() is None
    assert choose_tile("auto", torch.device("cpu"), 128, bf16, None) == 128
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert choose_tile("auto", cuda, 128, bf16, tuned) == 128
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert choose_tile("auto", cuda, 128, bf16, {**tuned, "bwd_BLOCK_M2": 128}) == 128
    assert choose_tile("auto", cuda, 128, bf16, tuned) == 64
    assert choose_tile(32, torch.device("cpu"), 128, bf16, None) == 32
    assert flex_choices_class() is None  # chosen, not installed
    with pytest.raises(ValueError, match=r"block sizes \{'fwd_BLOCK_M': 64, 'fwd_BLOCK_N': 64, "):
        choose_tile(32, cuda, 128, bf16, tuned)
    assert TrainConfig(flex_tile=64).flex_tile == 64
    for bad in (48, 256, "fast", True):
        with pytest.raises(ValueError, match="flex_tile must be auto, 16, 32, 64 or 128"):
            TrainConfig(flex_tile=bad)


def flex_choices_class() -> object:
    from torch._inductor import config

    return config.inductor_choices_class


def test_tune_drafter_sets_the_chosen_flex_settings(monkeypatch, inductor_choices):
    """tune_drafter tunes the model it is given, with the chosen kernel options and tile, and
    compiles nothing unless asked; it installs the tile hook (the only caller that does) when the
    tile is below 128, and leaves Inductor alone otherwise (CPU; a GPU without a tuned tile)."""
    from dflash_model.fast import tune_drafter
    from dflash_model.fast.flex import TUNED_FLEX_OPTIONS, choose_kernel_options, choose_tile

    bf16, cuda = torch.bfloat16, torch.device("cuda")
    model = make_drafter(num_layers=1, dtype=torch.float32, config_kw=dict(head_dim=128))  # a shape the tables know
    tuned = tune_drafter(model, torch.device("cpu"), bf16)
    assert tuned.model is model and not tuned.compiled and tuned.cache_url is None
    assert (model.flex_kernel_options, model.flex_tile) == (None, 128)
    assert flex_choices_class() is None
    given = {"bwd_num_warps": 4}
    tune_drafter(model, torch.device("cpu"), bf16, kernel_options=given, tile=128)
    assert model.flex_kernel_options == given and model.flex_kernel_options is not given
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert tune_drafter(model, cuda, bf16).model.flex_tile == 128
    assert flex_choices_class() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    options = choose_kernel_options("auto", cuda, 128, bf16)
    assert options == TUNED_FLEX_OPTIONS[((9, 0), 128, bf16)]
    assert choose_tile("auto", cuda, 128, bf16, options) == 64 and flex_choices_class() is None
    assert tune_drafter(model, cuda, bf16).model is model
    assert (model.flex_kernel_options, model.flex_tile) == (options, 64)
    assert flex_choices_class()().uuid() == "dflash-flex-tile-64"
