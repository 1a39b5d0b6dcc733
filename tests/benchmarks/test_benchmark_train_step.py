"""benchmarks/train_step.py: the drafter shapes it times, its phase breakdown, its CLI (CPU, tiny)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_phases as sp  # noqa: E402  (a script directory, not a package)
import train_step  # noqa: E402

from dflash_model.drafter import drafter_loss, sample_anchors, training_flops  # noqa: E402
from dflash_model.drafter.config import FULL  # noqa: E402
from dflash_model.drafter.loss import loss_chunks  # noqa: E402


def test_qwen36_27b_shape_is_the_drafter_a_run_builds():
    cfg = train_step.drafter_shape("qwen3.6-27b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (5120, 17408, 248320)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    rope = cfg.rope_parameters(FULL)
    assert rope["rope_theta"] == 1e7 and "partial_rotary_factor" not in rope and "mrope_section" not in rope
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61] and cfg.num_target_layers == 64
    assert cfg.mask_token_id == 248070 and cfg.num_layers == 5 and cfg.block_size == 16
    # the FLOP model reads these numbers: the LM head is 512 blocks x 15 rows x 5,120 x 248,320
    assert training_flops(cfg, 8192, 512, 0)["lm_head"] == 2.0 * 512 * 15 * 5120 * 248320


def test_qwen3_8b_shape_is_the_former_default():
    cfg = train_step.drafter_shape("qwen3-8b", layers=3)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (4096, 12288, 151936)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.rope_parameters(FULL)["rope_theta"] == 1e6
    assert cfg.target_layer_ids == [1, 17, 33] and cfg.mask_token_id == 151935 and cfg.num_layers == 3


def test_loss_chunks():
    assert loss_chunks(7680, 4096) == (2, 3840)
    assert loss_chunks(7680, 7680) == (1, 7680)
    assert loss_chunks(7680, 2560) == (3, 2560)
    assert loss_chunks(10, 4) == (3, 4)  # the last chunk padded by 2 rows


def _tiny_step(seed: int = 0, layers: int = 2):
    """A tiny drafter, one row, and a step(mark) as the benchmark's: loss, backward."""
    args = train_step.argparse.Namespace(shape="tiny", device="cpu", tokens=None, docs=3, anchors=None,
                                         block_size=4, layers=layers, features=None, seed=seed)
    s = train_step.make_setup(args, torch.float32, "sdpa")
    anchors = sample_anchors(s["loss_mask_cpu"], s["lengths"], s["N"], torch.Generator().manual_seed(seed))

    def step(mark=lambda _: None):
        mark("start")
        out = drafter_loss(s["model"], s["batch"], anchors, s["embed"], s["lm_head"], pad_anchors_to=s["N"],
                           chunk_rows=40)
        mark("forward")
        out.loss.backward()
        mark("backward")
        mark("optimizer")
        return out.loss.detach()

    return s["model"], step


def test_phase_marks_change_nothing_and_come_in_step_order():
    model, step = _tiny_step()
    clock = sp.PhaseClock(torch.device("cpu"), names=sp.STEP_MARKS)
    with sp.phase_marks(model, clock):
        loss = step(clock.mark)
    names = [name for name, _ in clock.marks]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert torch.equal(step(), loss)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert names == ["start", sp.PREP, sp.FC, sp.SETUP, sp.ATTN_FWD, sp.MLP_FWD, sp.ATTN_FWD, sp.ATTN_FWD,
                     sp.MLP_FWD, sp.NORM_FWD, sp.LOSS, sp.HEAD_BWD, sp.NORM_BWD, sp.MLP_BWD, sp.ATTN_BWD,
                     sp.MLP_BWD, sp.ATTN_BWD, sp.FC_BWD, sp.OPTIMIZER]
    # the context manager put the model back: no more marks
    n = len(clock.marks)
    step()
    assert len(clock.marks) == n


def test_breakdown_phases_add_up_to_the_marked_span():
    model, step = _tiny_step(layers=3)
    clock = sp.PhaseClock(torch.device("cpu"), names=sp.STEP_MARKS)
    with sp.phase_marks(model, clock):
        step(clock.mark)
    first, last = clock.marks[0][1], clock.marks[-1][1]
    phases = clock.phases()
    assert list(phases) == list(sp.ORDER) and clock.marks == []
    assert sum(phases.values()) == pytest.approx(last - first, rel=1e-9)
    table = sp.breakdown_table({"a": {"x": 1.0, "y": 3.0}, "b": {"y": 2.0}})
    assert [line.split() for line in table[1:]] == [["x", "1.00", "ms", "25.0%", "0.00", "ms", "0.0%"],
                                                    ["y", "3.00", "ms", "75.0%", "2.00", "ms", "100.0%"],
                                                    ["step", "(sum", "of", "phases)", "4.00", "ms", "2.00", "ms"]]


def test_cli_times_each_chunk_size_with_a_breakdown(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--tiny", "--device", "cpu", "--layers", "2",
                                      "--tokens", "128", "--anchors", "8", "--chunk-rows", "40,4096",
                                      "--breakdown", "1", "--warmup", "0", "--steps", "1", "--out", str(tmp_path)])
    assert train_step.main() == 0
    results = json.loads((tmp_path / "train_step.json").read_text())["results"]
    assert [(r["shape"], r["chunk_rows"], r["loss_chunks"]) for r in results] == [("tiny", 40, "3x40"),
                                                                                ("tiny", 4096, "1x120")]
    # the LM head's two products: 2 x 2 x (8 blocks x 15 rows) x 64 x 512 FLOPs, whatever the chunks
    assert [r["lm_head_tflop"] for r in results] == [4 * 120 * 64 * 512 / 1e12] * 2
    assert all(list(r["breakdown_ms"]) == list(sp.ORDER) for r in results)
    assert results[0]["drafter"]["vocab_size"] == 512


def test_the_cli_times_the_trainers_own_step(tmp_path, monkeypatch):
    """Every step it takes is ``Trainer.train_step``, the step the training loop takes, on one
    trainer: what it times is a run's step, not one of its own."""
    from dflash_stages.train.trainer import Trainer

    taken, real = [], Trainer.train_step

    def spy(self, rows, *args, **kw):
        taken.append(self)
        return real(self, rows, *args, **kw)

    monkeypatch.setattr(Trainer, "train_step", spy)
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--tiny", "--device", "cpu", "--layers", "1", "--tokens", "128",
                                      "--anchors", "8", "--breakdown", "1", "--warmup", "1", "--steps", "2"])
    assert train_step.main() == 0
    # the first step, 1 warm-up step, 2 timed alone, 2 back to back, 1 for the breakdown
    assert len(taken) == 7 and len({id(t) for t in taken}) == 1 and taken[0].step == 7


def test_chunk_rows_list_parsing():
    assert train_step.int_list("4096") == [4096]
    assert train_step.int_list("2560,3840,7680") == [2560, 3840, 7680]
    for bad in ("0", "4096,x", ""):
        with pytest.raises(train_step.argparse.ArgumentTypeError):
            train_step.int_list(bad)


def test_the_smollm2_shape_reads_the_quality_jobs_target_layers():
    """``--shape smollm2-135m --layers 4 --features 5``: the drafter the quality jobs train, reading
    the five layers their evaluate reports name (docs/data/quality_2026-12-04_session28)."""
    cfg = train_step.drafter_shape("smollm2-135m", 4, 16, 5)
    assert cfg.target_layer_ids == [1, 8, 14, 20, 27] and cfg.num_layers == 4
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_attention_heads) == (576, 1536, 49152, 9)
    assert len(train_step.drafter_shape("smollm2-135m", 4).target_layer_ids) == 4  # as many as draft layers
