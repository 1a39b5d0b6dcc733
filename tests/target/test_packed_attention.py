"""packed_flex (dflash_model/target/packed_attention.py): the target forward on packed rows through
flex_attention with a document-causal BlockMask. On CPU flex_attention runs eagerly, so these
tests check the mask and the wiring (registration, the mask reaching every layer, the extract
stage), in float32 against the sdpa + 4D-mask path and against each document run alone."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_model.target.capture import FeatureCapture
from dflash_model.target.load import load_target
from dflash_model.target.packed_attention import (
    NAME,
    doc_causal_mask_mod,
    document_ids,
    layer_windows,
    packed_block_mask,
    packed_model_mask,
    register,
    resolve_attn_implementation,
    row_attention_mask,
)
from dflash_model.target.packed_attention import packed_attention_mask
from dflash_stages.extract import ExtractConfig
from tests.stages.online_fixtures import tiny_target
from tests.stages.test_extract import LAYERS, extract, packed_row

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Qwen3 as test_extract (hidden states ~1: atol 1e-5 is tight); GQA 4/2."""
    return tiny_target(tmp_path_factory.getbasetemp(), initializer_range=0.1)


@pytest.fixture(scope="module")
def models(target: Path) -> dict[str, torch.nn.Module]:
    return {attn: load_target(str(target), "cpu", "float32", attn)[0] for attn in ("sdpa", NAME)}


def expected_allowed(doc_lengths: list[int], total: int, window: int | None = None) -> torch.Tensor:
    """[total, total] bool written out by loops: q sees kv iff same document and kv <= q (and
    q - kv < window); tokens after the last document see only themselves."""
    doc = [i for i, n in enumerate(doc_lengths) for _ in range(n)]
    doc += [-1 - i for i in range(len(doc), total)]
    out = torch.zeros(total, total, dtype=torch.bool)
    for q in range(total):
        for kv in range(q + 1):
            out[q, kv] = doc[q] == doc[kv] and (window is None or q - kv < window)
    return out


def dense(mask_mod, total: int) -> torch.Tensor:
    q = torch.arange(total)[:, None]
    kv = torch.arange(total)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, q, kv)


@pytest.mark.parametrize("window", [None, 4])
def test_block_mask_is_document_causal(window: int | None) -> None:
    """Token level: the BlockMask's own mask_mod, evaluated on the grid, is exactly the
    block-diagonal causal pattern (and, without a window, exactly what the 4D sdpa mask allows).
    Block level: a block is kept iff it holds an allowed pair, so cross-document blocks are
    skipped."""
    from torch.nn.attention.flex_attention import create_mask

    lengths, total, bs = [5, 9, 3], 20, 4
    want = expected_allowed(lengths, total, window)
    bm = packed_block_mask(lengths, total, "cpu", sliding_window=window, block_size=bs)
    assert bm.shape == (1, 1, total, total)
    got = create_mask(bm.mask_mod, 1, 1, total, total, device="cpu")[0, 0]
    assert torch.equal(got, want)
    if window is None:
        assert torch.equal(packed_attention_mask(lengths, total, torch.float32, "cpu")[0, 0] == 0, want)
    nb = -(-total // bs)
    padded = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
    padded[:total, :total] = want
    want_blocks = padded.view(nb, bs, nb, bs).any(dim=3).any(dim=1)
    assert torch.equal(bm.to_dense()[0, 0].bool(), want_blocks)
    # rows 8.. (documents 1, 2, padding) never read block 0 (document 0 only): skipped, as are
    # other cross-document blocks, so fewer blocks run than a causal mask's 15
    assert not want_blocks[2:, 0].any() and int(want_blocks.sum()) < 15


@pytest.mark.parametrize("lengths, total, window, bs", [
    ([5, 9, 3], 20, None, 4),
    ([5, 9, 3], 20, 4, 4),
    ([300, 700, 29], 1100, None, 128),   # padding tokens; total not a multiple of 128: full tiles too
    ([300, 700, 29], 1100, 200, 128),    # sliding window
    ([1024], 1024, None, (128, 64)),     # one document, unequal tile sides
])
def test_block_mask_equals_create_block_mask(lengths, total, window, bs) -> None:
    """The BlockMask built from interval overlaps is create_block_mask's, field for field."""
    from torch.nn.attention.flex_attention import create_block_mask

    ours = packed_block_mask(lengths, total, "cpu", sliding_window=window, block_size=bs)
    ref = create_block_mask(ours.mask_mod, None, None, total, total, device="cpu", BLOCK_SIZE=bs)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE


def test_mask_mod_past_the_row_end_is_safe() -> None:
    """flex may evaluate the mask on indices rounded up past the row: no index error, and a
    real query never sees a column past the end."""
    doc = document_ids([3, 2], 7, "cpu")
    assert doc.tolist() == [0, 0, 0, 1, 1, -6, -7]
    m = dense(doc_causal_mask_mod(doc), 16)
    assert not m[:7, 7:].any()
    assert torch.equal(m[:7, :7], expected_allowed([3, 2], 7))
    with pytest.raises(ValueError, match="do not fit"):
        document_ids([5, 5], 8, "cpu")


def test_layer_windows_and_model_mask() -> None:
    """One BlockMask for models of one layer kind; a {layer type: BlockMask} dict for models that
    mix full and sliding layers; other layer kinds are refused."""
    import transformers

    assert layer_windows(transformers.Qwen3Config()) == {"full_attention": None}
    assert layer_windows(transformers.LlamaConfig()) == {"full_attention": None}
    assert layer_windows(transformers.MistralConfig(sliding_window=16)) == {"sliding_attention": 16}
    mixed = transformers.Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                     max_window_layers=2)
    assert layer_windows(mixed) == {"full_attention": None, "sliding_attention": 8}
    masks = packed_model_mask(mixed, [10, 6], 20, "cpu")
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(dense(masks["sliding_attention"].mask_mod, 20), expected_allowed([10, 6], 20, 8))
    assert torch.equal(dense(masks["full_attention"].mask_mod, 20), expected_allowed([10, 6], 20))
    single = packed_model_mask(transformers.Qwen3Config(), [10, 6], 20, "cpu")
    assert torch.equal(dense(single.mask_mod, 20), expected_allowed([10, 6], 20))
    chunked = transformers.Qwen3Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows(chunked)


def test_implementation_names() -> None:
    """auto = packed_flex on CUDA, sdpa elsewhere; the extract config refuses other names."""
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("auto", torch.device("cuda:1")) == NAME
    assert resolve_attn_implementation("sdpa", "cuda") == "sdpa"
    assert ExtractConfig(model="m").attn_implementation == "auto"
    for bad in ("dflash_flex", "flash_attention_2"):
        with pytest.raises(ValueError, match="attn_implementation"):
            ExtractConfig(model="m", attn_implementation=bad)


def test_packed_row_features_equal_sdpa_and_each_document_alone(models) -> None:
    """A row of 3 documents plus 7 tokens after them: packed_flex features equal the sdpa + 4D
    mask features at every row (padding included: both give it the same rule), and each
    document's features equal its features run alone (plain causal sdpa, no mask given)."""
    sdpa, flex = models["sdpa"], models[NAME]
    assert flex.config._attn_implementation == NAME and sdpa.config._attn_implementation == "sdpa"
    lengths, total = [17, 30, 9], 63
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5999, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(total - sum(lengths))])[None]
    out = {}
    for attn, model in models.items():
        mask = row_attention_mask(model, lengths, total, torch.float32, "cpu")
        assert isinstance(mask, torch.Tensor) == (attn == "sdpa")
        out[attn] = FeatureCapture(model, LAYERS, last_hidden=True).capture(ids, pos, mask)
    feats, last = out[NAME]
    assert feats.shape == (1, total, len(LAYERS) * 64)
    torch.testing.assert_close(feats, out["sdpa"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(last, out["sdpa"][1], atol=1e-5, rtol=0)
    start = 0
    for n in lengths:
        alone, alone_last = FeatureCapture(sdpa, LAYERS, last_hidden=True).capture(ids[:, start:start + n])
        torch.testing.assert_close(feats[:, start:start + n], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(last[:, start:start + n], alone_last, atol=1e-5, rtol=0)
        start += n
    # the mask is what keeps them apart: one causal document over the same tokens differs
    joined = FeatureCapture(flex, LAYERS).capture(ids, pos, packed_block_mask([total], total, "cpu"))[0]
    assert (joined[:, 17:47] - feats[:, 17:47]).abs().max() > 1e-2


def test_without_a_block_mask_it_refuses(models) -> None:
    """No prepared mask would mean attention over everything: an error, not a silent result."""
    ids = torch.randint(0, 5999, (1, 8))
    with pytest.raises(TypeError, match="BlockMask"):
        FeatureCapture(models[NAME], [0]).capture(ids)


def test_sliding_layers_get_their_own_mask() -> None:
    """A Qwen3 whose upper layers slide (window 6): the dict of masks reaches each layer kind —
    every document of a packed row equals it alone under transformers' own sliding mask, with
    packed_flex and with sdpa (4D masks, one per kind), and giving the sliding layers the full
    mask instead changes the features. (6 query heads on 2 kv heads: a GQA group of 3.)"""
    import transformers

    register()
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=8, use_sliding_window=True, sliding_window=6,
                                   max_window_layers=2, initializer_range=0.1)
    assert cfg.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 3  # the last is not read
    torch.manual_seed(0)
    sdpa, flex = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),  # own configs
                                                                attn_implementation=attn).eval()
                  for attn in ("sdpa", NAME))
    flex.load_state_dict(sdpa.state_dict())
    lengths, total = [14, 11], 25
    ids = torch.randint(0, 512, (1, total), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    masks = row_attention_mask(flex, lengths, total, torch.float32, "cpu")
    assert set(masks) == {"full_attention", "sliding_attention"}
    feats = FeatureCapture(flex, [1, 3]).capture(ids, pos, masks)[0]
    dense_masks = row_attention_mask(sdpa, lengths, total, torch.float32, "cpu")
    assert set(dense_masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(dense_masks["sliding_attention"][0, 0] == 0, expected_allowed(lengths, total, 6))
    feats_sdpa = FeatureCapture(sdpa, [1, 3]).capture(ids, pos, dense_masks)[0]
    torch.testing.assert_close(feats_sdpa, feats, atol=1e-5, rtol=0)
    start = 0
    for n in lengths:
        alone = FeatureCapture(sdpa, [1, 3]).capture(ids[:, start:start + n])[0]
        torch.testing.assert_close(feats[:, start:start + n], alone, atol=1e-5, rtol=0)
        start += n
    no_window = dict(masks, sliding_attention=masks["full_attention"])
    wrong = FeatureCapture(flex, [1, 3]).capture(ids, pos, no_window)[0]
    assert (wrong[..., 32:] - feats[..., 32:]).abs().max() > 1e-3  # layer 3 slides
    torch.testing.assert_close(wrong[..., :32], feats[..., :32], atol=0, rtol=0)  # layer 1 is full


def test_extract_stage_packed_flex_equals_sdpa(target: Path, tmp_path: Path) -> None:
    """The extract stage with attn_implementation packed_flex yields the same items as with sdpa:
    the same header weights, and per row the same features and last hidden state (atol 1e-5)
    and the row's own fields."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 5999, n) for n in (17, 30, 9)]
    rows = [packed_row(docs, pad=8), packed_row([rng.integers(0, 5999, 40)]),
            packed_row([rng.integers(0, 5999, n) for n in (3, 1, 20)])]
    got = {attn: extract(target, rows, tmp_path, attn_implementation=attn, last_hidden=True)
           for attn in ("sdpa", NAME)}
    assert len(got[NAME]) == len(got["sdpa"]) == 4
    h_flex, h_sdpa = got[NAME][0], got["sdpa"][0]
    assert h_flex["target_layer_ids"] == h_sdpa["target_layer_ids"] == LAYERS
    assert torch.equal(h_flex["embed_weight"], h_sdpa["embed_weight"])
    for row, a, b in zip(rows, got[NAME][1:], got["sdpa"][1:]):
        assert a["features"].shape == (len(row["input_ids"]), len(LAYERS) * 64)
        torch.testing.assert_close(a["features"], b["features"], atol=1e-5, rtol=0)
        torch.testing.assert_close(a["last_hidden"], b["last_hidden"], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(a["input_ids"], row["input_ids"])
        assert a["doc_lengths"] == row["doc_lengths"] and a["state"] == row["state"]
