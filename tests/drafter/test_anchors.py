import math

import pytest
import torch
from conftest import packed_row

from dflash_model.drafter import (anchor_candidates, block_labels, build_blocks, doc_ids_from_lengths,
                                 sample_anchor_shares, sample_anchors, slot_weights, tau_serve, tau_sim)


def test_doc_ids_from_lengths_marks_padding():
    assert doc_ids_from_lengths([2, 3], 7).tolist() == [0, 0, 1, 1, 1, -1, -1]


def test_candidates_need_two_supervised_rows_in_one_document():
    docs = doc_ids_from_lengths([4, 4], 9)
    lm = torch.tensor([0, 1, 1, 1, 1, 1, 0, 1, 1])  # row 8 is padding
    # a=3: rows 3,4 straddle documents; a=5,6: loss_mask[6]=0; a=7: row 8 is padding
    assert anchor_candidates(lm, docs).tolist() == [1, 2, 4]


def test_sample_anchors_count_order_uniqueness_reproducibility():
    r = packed_row()
    cand = set(anchor_candidates(r["loss_mask"], doc_ids_from_lengths(r["doc_lengths"], 40)).tolist())
    a = sample_anchors(r["loss_mask"], r["doc_lengths"], 7, torch.Generator().manual_seed(3))
    assert a.dtype == torch.long and len(a) == 7 and torch.equal(a, a.sort().values)
    assert len(set(a.tolist())) == 7 and set(a.tolist()) <= cand
    assert torch.equal(a, sample_anchors(r["loss_mask"], r["doc_lengths"], 7, torch.Generator().manual_seed(3)))
    draws = {tuple(sample_anchors(r["loss_mask"], r["doc_lengths"], 7, torch.Generator().manual_seed(s)).tolist())
             for s in range(5)}
    assert len(draws) > 1  # afresh per draw
    every = sample_anchors(r["loss_mask"], None, 10_000, torch.Generator().manual_seed(0),
                           doc_ids=doc_ids_from_lengths(r["doc_lengths"], 40))
    assert set(every.tolist()) == cand  # min(N, #candidates)


@pytest.mark.parametrize("per_share, shares", [(4, 3), (7, 4)])
def test_anchor_shares_are_disjoint_draws_and_one_share_is_sample_anchors(per_share, shares):
    """Shares of ``per_share`` anchors, sorted, pairwise disjoint, drawn from the candidates; the
    first is what ``sample_anchors`` draws from the same generator state; when the candidates run
    out (7 x 4 > 21 candidates here) every candidate is drawn once, spread evenly over the shares."""
    r = packed_row()
    cand = set(anchor_candidates(r["loss_mask"], doc_ids_from_lengths(r["doc_lengths"], 40)).tolist())
    got = sample_anchor_shares(r["loss_mask"], r["doc_lengths"], per_share, shares, torch.Generator().manual_seed(3))
    assert len(got) == shares and all(torch.equal(a, a.sort().values) for a in got)
    drawn = [x for a in got for x in a.tolist()]
    assert len(drawn) == len(set(drawn)) == min(per_share * shares, len(cand)) and set(drawn) <= cand
    n = min(per_share * shares, len(cand))
    sizes = [n // shares + 1] * (n % shares) + [n // shares] * (shares - n % shares)
    assert sorted(len(a) for a in got) == sorted(sizes)
    first = sample_anchors(r["loss_mask"], r["doc_lengths"], len(got[0]), torch.Generator().manual_seed(3))
    assert torch.equal(got[0], first)


def test_labels_are_the_token_at_a_plus_k_and_never_cross_documents():
    r = packed_row()
    T, B = 40, 6
    docs = doc_ids_from_lengths(r["doc_lengths"], T)
    anchors = anchor_candidates(r["loss_mask"], docs)
    labels, sup, rows = block_labels(r["input_ids"], r["loss_mask"], docs, anchors, B)
    for n, a in enumerate(anchors.tolist()):
        for k in range(1, B):
            p = a + k
            want = p < T and docs[p] == docs[a] and r["loss_mask"][p] == 1
            assert bool(sup[n, k - 1]) == bool(want)
            if want:
                assert labels[n, k - 1] == r["input_ids"][p]  # the token AT a+k, not a+k+1
                assert rows[n, k - 1] == p
    assert sup[:, 0].all()  # slot 1 is always supervised: candidates guarantee loss_mask[a+1] = 1
    assert not sup.all()  # some blocks run into a document end or an unsupervised hole


def test_blocks_tokens_and_per_document_positions():
    r = packed_row()
    docs = doc_ids_from_lengths(r["doc_lengths"], 40)
    anchors = torch.tensor([5, 14, 30])  # one per document (starts 0, 12, 21)
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, 63)
    assert ids[:, 0].tolist() == r["input_ids"][anchors].tolist() and (ids[:, 1:] == 63).all()
    assert pos.tolist() == [[5, 6, 7, 8], [2, 3, 4, 5], [9, 10, 11, 12]]  # pos(a) + k, positions restart per doc
    assert layout.block_doc.tolist() == [0, 1, 2] and layout.block_start.tolist() == [5, 14, 30]


def test_slot_weights():
    w = slot_weights(4, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)], dtype=torch.float64))
    assert slot_weights(16, 7.0)[14].item() == math.exp(-2.0)


def test_tau_sim_counts_leading_correct_slots():
    c = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert tau_sim(c).item() == (3 + 1 + 4) / 3
    assert tau_serve(c).item() == pytest.approx(3 / (1 / 3 + 1 / 1 + 1 / 4))  # the harmonic mean
    valid = torch.tensor([True, False, True])
    assert tau_sim(c, valid).item() == (3 + 4) / 2 and tau_serve(c, valid).item() == pytest.approx(2 / (1 / 3 + 1 / 4))


def test_tau_serve_is_the_tau_of_a_decode_that_walks_the_text():
    """Where each stretch of text has one τ and spans whole cycles, a decode that drafts at its
    position, accepts, and moves on by τ makes exactly tau_serve tokens a cycle; tau_sim, the mean
    over every anchor, overstates it (here 5.5 against 1.8)."""
    B = 16
    taus = [10] * 50 + [1] * 50  # τ at each position of a 100-token text
    pos, cycles = 0, 0
    while pos < len(taus):
        pos, cycles = pos + taus[pos], cycles + 1
    lead = torch.tensor([[k < t - 1 for k in range(B - 1)] for t in taus])
    assert tau_sim(lead).item() == 5.5
    assert tau_serve(lead).item() == pytest.approx(len(taus) / cycles) == 100 / 55
