"""Exports as they are served: loaded by z-lab's reference loader and by AutoModel (our
modeling_dflash.py), under the transformers we install and under transformers 4.57.1 (z-lab's pin,
installed beside it into .venv-tf457 by ``bash scripts/install.sh test``), they draft what our
drafter drafts from the same weights and inputs.

The loaders run in fresh interpreters (served_loaders.py), one per transformers version for all
cases. Our side: ``load_drafter(export, float32)`` (the export's bf16 weights, so the weights are
identical) and ``draft_hidden``, one block after the whole context, which is what the reference
computes without a mask. The reference has no sliding-window mask of its own on CPU, so for the
sliding case it is given the window as an explicit mask built here from positions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, MASK_ID, VOCAB, qwen3_config

from dflash_model.drafter import DFlashDrafter, export_drafter, load_drafter
from dflash_model.drafter.draft import draft_hidden

REPO = Path(__file__).resolve().parents[2]
TF457 = REPO / ".venv-tf457"
RUNNER = Path(__file__).with_name("served_loaders.py")
T, B, WINDOW, FIRST_POS = 20, 4, 6, 300  # context rows, block size, sliding window, first position
SLIDING, FULL = "sliding_attention", "full_attention"


def _llama(rope: dict):
    import transformers

    # SmolLM2-like: a llama target (no q/k norms of its own; the drafter's layers are Qwen3 layers)
    return transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=48, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, num_hidden_layers=8, vocab_size=VOCAB,
                                    max_position_embeddings=8192, tie_word_embeddings=True, rope_parameters=rope)


def _qwen3(rope: dict, **kw):
    return qwen3_config(rope_parameters=rope, **kw)


def _qwen3_5_published():
    """The drafter a run builds for a (tiny) Qwen3.5/3.6 hybrid target by default: the published
    family shape (32 q / 8 kv heads of 128, full rotary, rope_theta 1e7), not the target's gated,
    partially rotated mRoPE attention, which a served Qwen3 layer could not reproduce."""
    import transformers

    from dflash_stages.train.config import TrainConfig
    from dflash_stages.train.drafter_init import drafter_config

    target = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, tie_word_embeddings=False)
    header = {"config": target.to_dict(), "embed_weight": torch.empty(VOCAB, 0), "tokenizer_len": VOCAB,
              "target_layer_ids": [1, 5]}
    cfg, source = drafter_config(header, TrainConfig(num_layers=2, block_size=B, mask_token_id=MASK_ID))
    assert source.startswith("published") and cfg.rope_parameters(FULL)["rope_theta"] == 1e7
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    return cfg


def _qwen3_wide_mlp():
    """A drafter whose MLP is wider than its target's (``intermediate_size``, a width sweep's point)."""
    from dflash_stages.train.config import TrainConfig
    from dflash_stages.train.drafter_init import drafter_config

    header = {"config": _qwen3(QWEN3_ROPE).to_dict(), "embed_weight": torch.empty(VOCAB, 0),
              "tokenizer_len": VOCAB, "target_layer_ids": [1, 5]}
    cfg, _ = drafter_config(header, TrainConfig(num_layers=2, block_size=B, mask_token_id=MASK_ID,
                                                intermediate_size=112))
    assert cfg.intermediate_size == 112
    return cfg


QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1e6}
# name: (target config, draft layer types, loaders)
CASES = {
    "qwen3": (lambda: _qwen3(QWEN3_ROPE), None, ("zlab", "auto")),
    "smollm2": (lambda: _llama({"rope_type": "default", "rope_theta": 1e5}), None, ("zlab", "auto")),
    "llama3": (lambda: _llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64, "rope_theta": 5e5}), None, ("zlab", "auto")),
    "yarn": (lambda: _qwen3({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "rope_theta": 1e6}), None, ("zlab", "auto")),
    # the reference applies one mask to every layer: all layers slide there
    "sliding": (lambda: _qwen3(QWEN3_ROPE, use_sliding_window=True, sliding_window=WINDOW), [SLIDING] * 2,
                ("zlab", "auto")),
    "mixed": (lambda: _qwen3(QWEN3_ROPE, use_sliding_window=True, sliding_window=WINDOW), [FULL, SLIDING], ("auto",)),
    "qwen3_5_published": (_qwen3_5_published, None, ("zlab", "auto")),
    "wide_mlp": (_qwen3_wide_mlp, None, ("zlab", "auto")),
}
ENVS = ("installed", "4.57")


def _sliding_mask(pos: torch.Tensor) -> torch.Tensor:
    """[1, 1, B, T + B] additive: a query sees keys at positions <= its own and within the window."""
    q, k = pos[0, -B:, None], pos[0, None, :]
    ok = (k <= q) & (q - k < WINDOW)
    return torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min)[None, None]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(our hidden states and LM head per case, the loaders' interpreters per env, their results)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("served")
    ours, jobs = {}, []
    for name, (target, layer_types, loaders) in CASES.items():
        torch.manual_seed(0)
        model = DFlashDrafter(target(), num_layers=2, block_size=B, mask_token_id=MASK_ID, target_layer_ids=[1, 5],
                              layer_types=layer_types)
        model.reset_parameters(std=0.3)  # large enough that attention is far from uniform
        export = export_drafter(model, root / name / "export")
        g = torch.Generator().manual_seed(1)
        E, W = torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g)
        features = torch.randn(T, 2 * HIDDEN, generator=g)
        pos = FIRST_POS + torch.arange(T + B)
        token = 7
        hidden = draft_hidden(load_drafter(export, dtype=torch.float32), [features], [pos[:T]], [token], E)[0]
        noise = E[torch.tensor([token] + [MASK_ID] * (B - 1))][None]
        inputs = {"target_hidden": features[None], "noise_embedding": noise, "position_ids": pos[None],
                  "split": torch.tensor([T // 2])}
        if name == "sliding":
            inputs["attention_mask"] = _sliding_mask(pos[None])
        save_file(inputs, str(root / name / "inputs.safetensors"))
        ours[name] = (hidden, W)
        jobs += [(name, loader) for loader in loaders]

    def start(env: str) -> tuple[subprocess.Popen | None, list[dict], Path]:
        spec = [{"loader": loader, "export": str(root / name / "export"), "inputs": str(root / name / "inputs.safetensors"),
                 "out": str(root / name / f"{env}-{loader}.safetensors")} for name, loader in jobs]
        (root / f"{env}.json").write_text(json.dumps(spec))
        log = root / f"{env}.log"
        environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        environ.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(root / f"modules-{env}"))
        if env == "4.57":
            if not (TF457 / "transformers").is_dir():
                return None, spec, log
            environ["PYTHONPATH"] = str(TF457)
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, str(RUNNER), str(root / f"{env}.json")], env=environ,
                                    stdout=out, stderr=subprocess.STDOUT), spec, log

    started = {env: start(env) for env in ENVS}  # both interpreters run at once
    yield ours, started, {}
    for proc, _, _ in started.values():
        if proc is not None and proc.poll() is None:  # not waited for (tests deselected)
            proc.kill()
            proc.wait()


def _result(served, env: str, name: str, loader: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The loader's outputs and info, read once the env's interpreter has finished."""
    from safetensors import safe_open

    _, started, results = served
    if env not in results:
        proc, spec, log = started[env]
        if proc is None:
            pytest.fail(f"transformers 4.57.1 is missing from {TF457}: run `bash scripts/install.sh test`")
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
        results[env] = {}
        for s in spec:
            with safe_open(s["out"], "pt") as f:
                info = json.loads(f.metadata()["info"])
                results[env][Path(s["out"]).parent.name, s["loader"]] = ({k: f.get_tensor(k) for k in f.keys()}, info)
    return results[env][name, loader]


def _assert_same_drafts(ours: torch.Tensor, theirs: torch.Tensor, W: torch.Tensor) -> None:
    """Logits through a shared LM head: relative error <= 1e-4 (fp32), the same top-1 in every slot."""
    a, b = ours @ W.T, theirs @ W.T
    rel = float((a - b).norm() / b.norm())
    assert rel <= 1e-4, f"logits differ by {rel:.3g} relative"
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "zlab" in c[2]])
def test_reference_loader_drafts_what_we_draft(served, env, name):
    """z-lab's DFlashDraftModel.from_pretrained(export): every tensor loads, it reads our RoPE and
    windows, and its block equals ours."""
    out, info = _result(served, env, name, "zlab")
    assert info["transformers"].startswith("4.57.") == (env == "4.57")
    assert (info["missing"], info["unexpected"]) == ([], [])
    assert info["sliding_windows"] == ([WINDOW, WINDOW] if name == "sliding" else [None, None])
    hidden, W = served[0][name]
    _assert_same_drafts(hidden, out["hidden"][0, 1:], W)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("name", list(CASES))
def test_automodel_route_loads_our_model_file(served, env, name):
    """AutoModel.from_pretrained(export, trust_remote_code=True) gives modeling_dflash's
    DFlashDraftModel, every tensor loaded, drafting what we draft, also through a KV cache."""
    out, info = _result(served, env, name, "auto")
    assert (info["type"], info["missing"], info["unexpected"]) == ("DFlashDraftModel", [], [])
    assert info["sliding_windows"] == [WINDOW if lt == SLIDING else None for lt in CASES[name][1] or [FULL] * 2]
    hidden, W = served[0][name]
    _assert_same_drafts(hidden, out["hidden"][0, 1:], W)
    torch.testing.assert_close(out["cached"], out["hidden"], rtol=1e-5, atol=1e-5)
