"""extract:hf_hooks through the stage itself (``HFHooksExtract(...).run``) on a tiny random
Qwen3: the header item, the layer-id convention, and documents of a packed row kept apart."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from dflash_core.stage import StageContext
from dflash_model.fast.settings import DtypeName
from dflash_model.target.load import resolve_dtype
from dflash_stages.extract import ExtractConfig, HFHooksExtract
from tests.stages.online_fixtures import tiny_target

LAYERS = [0, 2, 1]  # not sorted: features come in the order asked for
H = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """initializer_range 0.1: hidden states of magnitude ~1 (max ~3), so that the absolute
    tolerance 1e-5 is tight but above fp32 rounding (the training target's 0.5 gives ~400)."""
    return tiny_target(tmp_path_factory.getbasetemp(), initializer_range=0.1)


@pytest.fixture(scope="module")
def hf_model(target: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return model


def extract(target: Path, rows: list[dict], tmp_path: Path, **cfg) -> list[dict]:
    stage = HFHooksExtract(ExtractConfig(**{"model": str(target), "layers": LAYERS, **cfg}))
    ctx = StageContext(stage="extract", config=stage.config, device="cpu", run_dir=str(tmp_path),
                       work_dir=str(tmp_path), cache_dir=str(tmp_path))
    return list(stage.run({"rows": rows}, ctx))


def packed_row(docs: list[np.ndarray], pad: int = 0) -> dict:
    """A row in pack's format: documents back to back, positions restarting per document,
    padding as a last 'document' of pad tokens (as pack:best_fit with pad_to does)."""
    lengths = [len(d) for d in docs] + ([pad] if pad else [])
    ids = np.concatenate(docs + ([np.zeros(pad, np.int64)] if pad else []))
    mask = np.concatenate([np.ones(len(d), np.uint8) for d in docs]
                          + ([np.zeros(pad, np.uint8)] if pad else []))
    pos = np.concatenate([np.arange(n) for n in lengths])
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos, "doc_lengths": lengths,
            "state": {"position": 1}, "state_stage": "pack", "epochs": 1, "rows_per_epoch": 1}


def packed_alone_joined(target: Path, lengths: tuple[int, ...], pad: int, tmp_path: Path,
                        **cfg) -> tuple[dict, list[dict], dict]:
    """extract's items for random documents of ``lengths`` packed in one row with ``pad`` tokens of
    padding, for each document alone, and for all of them as one document: what a test of
    document isolation compares."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5999, n) for n in lengths]
    rows = [packed_row(docs, pad=pad), *[packed_row([d]) for d in docs], packed_row([np.concatenate(docs)])]
    items = extract(target, rows, tmp_path, **cfg)
    return items[1], items[2:-1], items[-1]


def test_header_then_features_per_row(target: Path, hf_model, tmp_path: Path) -> None:
    """First item: the target header (layer ids, frozen embedding / LM head weights, config,
    tokenizer facts); then one item per row with features [T, k*H], the row's own fields
    passed through, and no last hidden state unless asked for."""
    rng = np.random.default_rng(0)
    rows = [packed_row([rng.integers(0, 5999, 20)]), packed_row([rng.integers(0, 5999, 9)] * 2)]
    items = extract(target, rows, tmp_path)
    assert len(items) == 3
    header = items[0]
    assert header["kind"] == "target" and header["target_layer_ids"] == LAYERS
    assert header["model"] == str(target)
    assert torch.equal(header["embed_weight"], hf_model.get_input_embeddings().weight)
    assert torch.equal(header["lm_head_weight"], hf_model.get_output_embeddings().weight)
    assert header["config"]["num_hidden_layers"] == 4 and header["config"]["hidden_size"] == H
    assert header["tokenizer_len"] > 0 and isinstance(header["all_special_ids"], list)
    for row, item in zip(rows, items[1:]):
        assert item["kind"] == "row"
        assert item["features"].shape == (len(row["input_ids"]), len(LAYERS) * H)
        assert item["features"].dtype == torch.float32  # dtype auto on CPU
        assert item["last_hidden"] is None
        assert item["state"] == row["state"] and item["state_stage"] == "pack"
        np.testing.assert_array_equal(item["input_ids"], row["input_ids"])


def test_layer_id_t_is_hf_hidden_states_t_plus_1(target: Path, hf_model, tmp_path: Path) -> None:
    """For a single document, the features of id t equal HF ``output_hidden_states[t + 1]``
    (the output of decoder layer t, 0-based), in the order of ``layers``."""
    ids = np.random.default_rng(1).integers(0, 5999, 24)
    feats = extract(target, [packed_row([ids])], tmp_path)[1]["features"]
    with torch.no_grad():
        hs = hf_model(torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
    for i, t in enumerate(LAYERS):
        torch.testing.assert_close(feats[:, i * H:(i + 1) * H], hs[t + 1][0], atol=1e-5, rtol=0)


def test_documents_of_a_packed_row_do_not_see_each_other(target: Path, tmp_path: Path) -> None:
    """The features of each document inside a packed row (with padding) equal its features
    extracted alone, within atol 1e-5 in fp32; last_hidden (for the target losses) too."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 5999, n) for n in (17, 30, 9)]
    packed = packed_row(docs, pad=8)
    alone = [packed_row([d]) for d in docs]
    items = extract(target, [packed, *alone], tmp_path, last_hidden=True)
    feats, last = items[1]["features"], items[1]["last_hidden"]
    assert feats.shape == (17 + 30 + 9 + 8, len(LAYERS) * H) and last.shape == (64, H)
    start = 0
    for doc, item in zip(docs, items[2:]):
        n = len(doc)
        torch.testing.assert_close(feats[start:start + n], item["features"], atol=1e-5, rtol=0)
        torch.testing.assert_close(last[start:start + n], item["last_hidden"], atol=1e-5, rtol=0)
        start += n
    assert torch.isfinite(feats).all()  # padding rows too
    # and the mask matters: the same tokens as one causal document give other features
    joined = extract(target, [packed_row([np.concatenate(docs)])], tmp_path)[1]["features"]
    assert (joined[17:47] - feats[17:47]).abs().max() > 1e-2


def test_compiled_layers_give_the_eager_features(target: Path, tmp_path: Path) -> None:
    """``compile: on`` (the CUDA default; Inductor's CPU backend here) yields the eager features
    of every row and the last hidden state, with the hooks outside the compiled graph: one graph
    serves all layers and rows of one length."""
    rng = np.random.default_rng(3)
    rows = [packed_row([rng.integers(0, 5999, 20), rng.integers(0, 5999, 12)]) for _ in range(2)]
    eager = extract(target, rows, tmp_path, compile="off", last_hidden=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = extract(target, rows, tmp_path, compile="on", last_hidden=True)
    for e, c in zip(eager[1:], compiled[1:]):
        torch.testing.assert_close(c["features"], e["features"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c["last_hidden"], e["last_hidden"], atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="compile must be auto, on or off"):
        ExtractConfig(model=str(target), compile="yes")


def test_rows_without_the_trainer_fields_are_refused_naming_the_packer(target: Path, tmp_path: Path) -> None:
    """A packer that leaves out the schedule / resume fields fails where its rows enter extract."""
    from dflash_core.rows import RowError

    row = packed_row([np.arange(12)])
    del row["rows_per_epoch"], row["epochs"]
    stage = HFHooksExtract(ExtractConfig(model=str(target), layers=LAYERS))
    ctx = StageContext(stage="extract", config=stage.config, device="cpu", run_dir=str(tmp_path),
                       work_dir=str(tmp_path), cache_dir=str(tmp_path),
                       pipeline={"extract": {"kind": "extract", "after": {"rows": "my_pack"}}})
    with pytest.raises(RowError, match="stage 'extract' got a packed row from stage 'my_pack' without "
                                       "'epochs', 'rows_per_epoch'"):
        list(stage.run({"rows": [row]}, ctx))


def test_packed_flex_calls_go_through_the_compile_gate_with_eager_layers(target: Path, tmp_path: Path) -> None:
    """packed_flex compiles its flex_attention on CUDA even with ``compile: off``: the first call at
    a length must run alone (a compile overlapping another stage's in the process fails the run)."""
    from dflash_model.fast.compile_gate import GATE

    rng = np.random.default_rng(4)
    rows = [packed_row([rng.integers(0, 5999, 20), rng.integers(0, 5999, 12)])]
    stage = HFHooksExtract(ExtractConfig(model=str(target), layers=LAYERS, compile="off",
                                         attn_implementation="packed_flex"))
    ctx = StageContext(stage="extract-gated", config=stage.config, device="cpu", run_dir=str(tmp_path),
                       work_dir=str(tmp_path), cache_dir=str(tmp_path))
    assert not GATE.is_warm("extract-gated", 32)
    list(stage.run({"rows": rows}, ctx))
    assert GATE.is_warm("extract-gated", 32) and not GATE.is_warm("extract-gated", 33)


def test_every_dtype_a_config_accepts_is_one_the_loader_knows():
    """The configs' dtype choices (checked before the run) and the loader's names agree."""
    assert {resolve_dtype(name, "cpu") for name in get_args(DtypeName)} == {
        torch.float32, torch.bfloat16, torch.float16}
