import pytest
import torch
from conftest import MASK_ID, make_drafter, packed_row

from dflash_model.drafter import build_blocks, doc_ids_from_lengths, draft_block


@pytest.mark.parametrize("kw", [{}, dict(layer_types=["sliding_attention", "full_attention"],
                                         config_kw=dict(use_sliding_window=True, sliding_window=4))])
def test_draft_block_equals_training_forward_at_that_anchor(kw):
    """Inference drafting = the training path for an anchor whose context is every earlier row."""
    r = packed_row(doc_lengths=(30,), pad=0)
    model = make_drafter(**kw)
    docs = doc_ids_from_lengths([30], 30)
    for a in (1, 17):
        ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, torch.tensor([a]), 4, MASK_ID)
        want = (model(r["features"], ids, r["position_ids"], pos, layout, r["E"])[0] @ r["W"].T).argmax(-1)
        got = draft_block(model, r["features"][:a], r["position_ids"][:a], int(r["input_ids"][a]), r["E"], r["W"])
        assert got.tolist() == want.tolist() and got.shape == (3,)
        # an explicit position gives the same result; positions enter only relatively
        got2 = draft_block(model, r["features"][:a], r["position_ids"][:a] + 5, int(r["input_ids"][a]), r["E"], r["W"],
                           last_position=a + 5)
        assert got2.tolist() == want.tolist()


def test_draft_block_without_context_needs_a_position():
    r = packed_row()
    model = make_drafter()
    with pytest.raises(ValueError):
        draft_block(model, r["features"][:0], r["position_ids"][:0], 3, r["E"], r["W"])
    empty = draft_block(model, r["features"][:0], r["position_ids"][:0], 3, r["E"], r["W"], last_position=0)
    assert empty.shape == (3,)


@pytest.mark.parametrize("kw", [{}, dict(layer_types=["sliding_attention", "full_attention"],
                                         config_kw=dict(use_sliding_window=True, sliding_window=4))])
def test_draft_blocks_of_several_contexts_equal_each_drafted_alone(kw):
    """Batched drafting packs the contexts as documents: no block sees another sequence's context."""
    from dflash_model.drafter import draft_blocks
    from dflash_model.drafter.draft import draft_hidden

    r = packed_row(doc_lengths=(30,), pad=0)
    model = make_drafter(**kw)
    cuts = [(0, 5), (3, 20), (10, 11), (0, 29)]
    feats = [r["features"][a:b] for a, b in cuts]
    pos = [torch.arange(b - a) for a, b in cuts]
    tokens = [int(r["input_ids"][b]) for _, b in cuts]
    alone = torch.stack([draft_hidden(model, [f], [p], [t], r["E"])[0] for f, p, t in zip(feats, pos, tokens)])
    together = draft_hidden(model, feats, pos, tokens, r["E"])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert draft_blocks(model, feats, pos, tokens, r["E"], r["W"]).tolist() == \
        [draft_block(model, f, p, t, r["E"], r["W"]).tolist() for f, p, t in zip(feats, pos, tokens)]
