"""The declared row schema: a row missing a field the trainer relies on, or with per-token fields
of different lengths, is an error naming the stage that produced it."""

from __future__ import annotations

import pytest

from dflash_core.rows import FEATURE_ROW, PACKED_ROW, RowError, check_row, checked

ROW = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1], "position_ids": [0, 1, 0, 1],
       "doc_lengths": [2, 2], "state": {"position": 1}, "state_stage": "pack", "epochs": 1,
       "rows_per_epoch": 3}


def test_a_complete_row_passes_and_the_header_is_not_a_row():
    header = {"kind": "target", "model": "m"}
    assert list(checked([header, ROW], PACKED_ROW, "extract", "pack")) == [header, ROW]


@pytest.mark.parametrize("field", PACKED_ROW.names)
def test_each_missing_field_names_the_producer(field):
    row = {k: v for k, v in ROW.items() if k != field}
    with pytest.raises(RowError, match=rf"stage 'extract' got a packed row from stage 'my_pack' without '{field}'"):
        list(checked([row], PACKED_ROW, "extract", "my_pack"))


def test_feature_rows_need_features():
    with pytest.raises(RowError, match="stage 'train' got a feature row from stage 'extract' without 'features'"):
        check_row(ROW, FEATURE_ROW, "train", "extract")


def test_fields_of_different_lengths_are_refused():
    with pytest.raises(RowError, match="4 input_ids, 3 loss_mask, 4 position_ids, doc_lengths summing to 4"):
        check_row({**ROW, "loss_mask": [1, 1, 1]}, PACKED_ROW, "extract", "pack")
    with pytest.raises(RowError, match="doc_lengths summing to 5"):
        check_row({**ROW, "doc_lengths": [2, 3]}, PACKED_ROW, "extract", "pack")


def test_docs_pack_md_names_every_field():
    from tests.conftest import REPO

    text = (REPO / "docs" / "pack.md").read_text()
    assert all(f"`{name}`" in text for name in PACKED_ROW.names)


def test_the_row_builders_write_exactly_the_declared_fields():
    """Producers build rows with these, so a field renamed in the schema is renamed for all."""
    from dflash_core.rows import (KIND, ROW_KIND, feature_row, is_row, is_target_header, packed_row,
                                  producer_fields)

    row = packed_row([5, 6], [0, 1], [0, 1], [2], **producer_fields(state={"position": 1}, stage="pack",
                                                                     epochs=2, rows_per_epoch=3))
    assert set(row) == set(PACKED_ROW.names)
    check_row(row, PACKED_ROW, "extract", "pack")
    featured = feature_row(row, features=[[0.0], [1.0]])
    assert set(featured) == set(FEATURE_ROW.names) | {f.name for f in FEATURE_ROW.optional}
    assert featured[KIND] == ROW_KIND and is_row(featured) and is_row(row)
    check_row(featured, FEATURE_ROW, "train", "extract")
    header = {KIND: "target", "model": "m"}
    assert is_target_header(header) and not is_row(header) and not is_target_header(featured)


def test_the_built_in_producers_write_packed_rows():
    import numpy as np

    from dflash_stages.pack.packing import BestFitPacker, SampleIndex
    from dflash_stages.pack.random_rows import RandomRowsConfig, random_row

    assert set(random_row(RandomRowsConfig(tokens_per_row=16, docs_per_row=2), 0)) == set(PACKED_ROW.names[:4])
    samples = [{"input_ids": np.arange(n), "loss_mask": np.ones(n, np.int8)} for n in (3, 5, 4)]
    index = SampleIndex.build(samples)
    try:
        row = next(iter(BestFitPacker(index, tokens_per_row=8)))
    finally:
        index.close()
    assert set(PACKED_ROW.names[:4]) | {"state"} <= set(row)


def test_the_target_header_is_what_the_schema_says_and_train_checks_it(tmp_path):
    """extract's header (``target_header`` on a real model) carries exactly TARGET_HEADER's fields;
    train refuses a header without one, naming the stage that sent it, before it builds anything."""
    import pytest
    import torch
    import transformers

    from dflash_core import StageContext
    from dflash_core.rows import TARGET_HEADER, RowError
    from dflash_model.target.capture import target_header
    from dflash_stages.train.config import TrainConfig
    from dflash_stages.train.stage import DFlashTrain
    from tests.assets import unpack_qwen3_tokenizer

    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(unpack_qwen3_tokenizer(tmp_path / "tok"))
    header = target_header("tiny", model, [0], tok)
    assert set(header) == set(TARGET_HEADER.names)

    ctx = StageContext(stage="train", config=TrainConfig(), device="cpu", run_dir=str(tmp_path),
                       pipeline={"train": {"after": {"features": "extract"}}})
    broken = {k: v for k, v in header.items() if k != "lm_head_weight"}
    with pytest.raises(RowError, match="stage 'train' got a target header from stage 'extract' without "
                                       "'lm_head_weight'"):
        next(DFlashTrain(TrainConfig()).run({"features": iter([broken])}, ctx))
