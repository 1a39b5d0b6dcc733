import pytest
import torch
from conftest import make_drafter, packed_row

from dflash_model.drafter import BlockLayout, build_blocks, doc_ids_from_lengths, sample_anchors

# T = 7 rows: doc 0 = rows 0-2, doc 1 = rows 3-5, row 6 padding; anchors 1, 3, 4; B = 2.
DOCS = doc_ids_from_lengths([3, 3], 7)
SMALL = BlockLayout(ctx_doc=DOCS, block_doc=DOCS[torch.tensor([1, 3, 4])],
                    block_start=torch.tensor([1, 3, 4]), block_size=2)


def _rows(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_dense_mask_exact_full_attention():
    #          context 0..6          | block0 | block1 | block2
    expected = _rows(
        [1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # block 0 (anchor 1, doc 0): row 0 only, not the anchor
        [1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # block 1 (anchor 3 = doc 1's first row): no context
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1],  # block 2 (anchor 4): row 3 only, never doc 0 or padding
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    )
    assert torch.equal(SMALL.dense_mask(), expected)


def test_dense_mask_exact_sliding_window():
    expected = _rows(
        [1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # slot 0 at row 1 sees row 0 (distance 1 < 2), itself
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # slot 1 (row 2): row 0 is 2 away -> out; causal block
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    )
    assert torch.equal(SMALL.dense_mask(sliding_window=2), expected)


def _packed_layout(B=4, n=12, seed=0):
    r = packed_row(seed)
    docs = doc_ids_from_lengths(r["doc_lengths"], r["input_ids"].shape[0])
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], n, torch.Generator().manual_seed(seed))
    return build_blocks(r["input_ids"], r["position_ids"], docs, anchors, B, 63)[2], anchors, docs


def test_packed_row_mask_never_sees_anchor_or_later_other_docs_or_blocks():
    layout, anchors, docs = _packed_layout()
    T, B = layout.num_context, layout.block_size
    for window in (None, 3):
        m = layout.dense_mask(window)
        for q in range(layout.q_len):
            j, a = q // B, int(anchors[q // B])
            ctx = m[q, :T].nonzero().squeeze(1)
            assert (ctx < a).all() and (docs[ctx] == docs[a]).all()
            blocks = m[q, T:].view(-1, B)
            assert not blocks[torch.arange(len(anchors)) != j].any()
            if window is None:
                assert torch.equal(ctx, torch.arange(a)[docs[:a] == docs[a]])
                assert blocks[j].all()


def test_mask_mod_elementwise_equals_dense_mask():
    z = torch.tensor(0)
    for window in (None, 2):  # scalar calls, as flex evaluates it
        mm = SMALL.mask_mod(window)
        loop = torch.tensor([[bool(mm(z, z, torch.tensor(q), torch.tensor(kv))) for kv in range(SMALL.kv_len)]
                             for q in range(SMALL.q_len)])
        assert torch.equal(loop, SMALL.dense_mask(window))
    for layout in (SMALL, _packed_layout()[0]):  # vmapped, as create_block_mask evaluates it
        for window in (None, 2, 5):
            vm = torch.vmap(torch.vmap(layout.mask_mod(window), in_dims=(None, None, None, 0)),
                            in_dims=(None, None, 0, None))
            assert torch.equal(vm(z, z, torch.arange(layout.q_len), torch.arange(layout.kv_len)),
                               layout.dense_mask(window))


def test_attended_pairs_counts_the_mask():
    for layout in (SMALL, _packed_layout()[0]):
        for window in (None, 1, 2, 5, 100):
            assert layout.attended_pairs(window) == int(layout.dense_mask(window).sum())


def test_flex_block_mask_matches_dense_mask():
    layout = _packed_layout()[0]
    for window in (None, 3):
        bm = layout.flex_block_mask(window)
        assert torch.equal(bm.mask_mod(torch.tensor(0), torch.tensor(0), torch.arange(layout.q_len)[:, None],
                                       torch.arange(layout.kv_len)[None, :]), layout.dense_mask(window))
        assert (bm.seq_lengths[0], bm.seq_lengths[1]) == (layout.q_len, layout.kv_len)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_sdpa_forward_on_cpu():
    r = packed_row(dtype=torch.float32)
    model = make_drafter(dtype=torch.float32, layer_types=["full_attention", "sliding_attention"],
                         config_kw=dict(use_sliding_window=True, sliding_window=5))
    docs = doc_ids_from_lengths(r["doc_lengths"], r["input_ids"].shape[0])
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], 10, torch.Generator().manual_seed(1))
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, 63)
    with torch.no_grad():
        outs = [model(r["features"], ids, r["position_ids"], pos, layout, r["E"], attn_backend=b)
                for b in ("sdpa", "flex")]
        model.flex_tile = 16  # a smaller BlockMask tile (see fast.flex): the same result
        outs.append(model(r["features"], ids, r["position_ids"], pos, layout, r["E"], attn_backend="flex"))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T, lengths, n, B, pad_to", [
    (8192, [2731, 2731, 2730], 512, 16, None),  # the benchmark row: Q and KV multiples of 128
    (1000, [300, 500], 37, 10, None),           # padding context rows; Q, KV, B not multiples of 128
    (1000, [300, 500], 37, 10, 50),             # padding blocks (see only themselves)
    (300, [100, 150, 40], 200, 3, 260),         # more blocks than tiles hold evenly
    (4096, [4096], 64, 16, None),               # one document: many full tiles
])
@pytest.mark.parametrize("tile", [128, 64])
def test_flex_block_mask_equals_create_block_mask(T, lengths, n, B, pad_to, tile):
    """The BlockMask built from per-block counts is create_block_mask's, field for field, at
    torch's default tile and at the H200's (fast.flex.TUNED_FLEX_TILE)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_model.drafter.anchors import pad_anchors

    g = torch.Generator().manual_seed(T + n)
    docs = doc_ids_from_lengths(lengths, T)
    anchors, valid = pad_anchors(sample_anchors(torch.ones(T, dtype=torch.long), lengths, n, g), pad_to)
    layout = build_blocks(torch.randint(0, 100, (T,), generator=g), torch.arange(T), docs, anchors, B, 0, valid)[2]
    ours = layout.flex_block_mask(tile=tile)
    ref = create_block_mask(layout.mask_mod(), None, None, layout.q_len, layout.kv_len, device="cpu",
                            BLOCK_SIZE=tile)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    assert int(ours.kv_num_blocks.sum() + ours.full_kv_num_blocks.sum()) > 0

