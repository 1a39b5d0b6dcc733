"""Plant the pitfalls of docs/drafter.md ('Pitfalls') in a trained drafter: served τ collapses, τ_sim (measured the same
broken way training measures it) stays high, and the evaluate report flags the gap.

The target is a tiny Qwen3 with hand-set weights whose greedy continuation is exactly learnable:
attention is off, layer 0's MLP maps token x's embedding code to perm[x]'s code and layer 1 maps
that to perm[perm[x]]'s, and the LM head reads codes back, so next = perm²[x], layer-0 features
encode a half step and layer-1 features encode the next token. A one-layer DFlash drafter learns
it in ~100 CPU steps with ``drafter_loss`` + AdamW.

Each pitfall is planted in the shared training code (monkeypatched) for both training and the
report's teacher-forced τ_sim — the situation of a trainer with the bug — while the serving path
(``draft_block`` in the real speculative decoding loop, features from hooks in the cached forward)
stays correct:

* shifted labels: slot k is trained on the token at a+k+1 (``block_labels`` with anchors + 1);
* ±1 layer ids: the export says layer 0, the training features came from layer 1
  (``FeatureCapture.capture`` with ids + 1);
* anchor visible: the context mask lets block j see context row a_j (``build_blocks`` with
  ``block_start + 1``); weaker on this target (measured gap ~19% vs ~66%), still flagged.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dflash_model.drafter import DFlashDrafter, FeatureBatch, anchor_candidates, drafter_loss, export_drafter
import dflash_model.drafter.loss as drafter_loss_module
from dflash_model.drafter.mask import BlockLayout
from dflash_model.target.capture import FeatureCapture
from dflash_stages.evaluate.export import evaluate_export

V, H, B, PROMPT, COMPLETION = 64, 32, 4, 4, 20


def perm_target(seed: int = 0):
    """(model, perm): a 3-layer Qwen3 whose greedy next token is perm[perm[x]], exactly: layers 0
    and 1 each map code x to code perm[x]; layer 2, an identity, is there because the last layer
    is not a readable feature layer (serving reads it after the final norm)."""
    import transformers

    g = torch.Generator().manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=V, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    E = torch.randn(V, H, generator=g)
    perm = torch.randperm(V, generator=g)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(E)
        model.lm_head.weight.copy_(E)
        En = E / E.norm(dim=1, keepdim=True)
        hn = E * torch.rsqrt(E.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)  # the MLP's normed input
        z = hn @ (4 * En).t()
        act = torch.nn.functional.silu(z) * z                   # SwiGLU activations for each code
        down = torch.linalg.lstsq(act, E[perm] - E).solution    # mlp(code x) = code perm[x] - code x
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.gate_proj.weight.copy_(4 * En)
            layer.mlp.up_proj.weight.copy_(4 * En)
            layer.mlp.down_proj.weight.copy_(down.t())
        model.model.layers[-1].mlp.down_proj.weight.zero_()
    model.requires_grad_(False)
    return model, perm


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    model, perm = perm_target()
    x = torch.randint(0, V, (72, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(COMPLETION):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    pp = perm[perm]
    assert torch.equal(x[:, PROMPT:], pp[x[:, PROMPT - 1:-1]])  # the target really is next = perm²[x]
    return model, x


# --------------------------------------------------------------------------- the planted bugs
_real_block_labels = drafter_loss_module.block_labels
_real_build_blocks = drafter_loss_module.build_blocks
_real_capture = FeatureCapture.capture


def _shifted_labels(input_ids, loss_mask, doc_ids, anchors, block_size, valid=None):
    return _real_block_labels(input_ids, loss_mask, doc_ids, anchors + 1, block_size, valid)


def _anchor_visible(input_ids, position_ids, doc_ids, anchors, block_size, mask_token_id, valid=None):
    ids, pos, lay = _real_build_blocks(input_ids, position_ids, doc_ids, anchors, block_size, mask_token_id, valid)
    return ids, pos, BlockLayout(lay.ctx_doc, lay.block_doc, lay.block_start + 1, block_size)


def _capture_next_layer(self, input_ids, *a, **kw):
    saved = self.layer_ids
    self.layer_ids = [t + 1 for t in saved]
    try:
        return _real_capture(self, input_ids, *a, **kw)
    finally:
        self.layer_ids = saved


@contextlib.contextmanager
def planted(pitfall: str, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as mp:
        if pitfall == "shifted_labels":
            mp.setattr(drafter_loss_module, "block_labels", _shifted_labels)
        elif pitfall == "anchor_visible":
            mp.setattr(drafter_loss_module, "build_blocks", _anchor_visible)
        elif pitfall == "layer_ids_plus_1":
            mp.setattr(FeatureCapture, "capture", _capture_next_layer)
        yield


def train(model, seqs: torch.Tensor, layer_ids: list[int], steps: int = 150, per_step: int = 8) -> DFlashDrafter:
    """The DFlash drafter trained with drafter_loss + AdamW on the target's greedy sequences."""
    torch.manual_seed(1)
    drafter = DFlashDrafter(model.config, num_layers=1, block_size=B, target_layer_ids=layer_ids,
                            mask_token_id=0, attn_backend="sdpa")
    feats, _ = FeatureCapture(model, layer_ids).capture(seqs)
    T = seqs.shape[1]
    loss_mask = torch.zeros(T, dtype=torch.long)
    loss_mask[PROMPT:] = 1
    anchors = anchor_candidates(loss_mask, torch.zeros(T, dtype=torch.long))
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    rows = seqs.shape[0] // per_step
    for step in range(steps):
        j = (step % rows) * per_step
        batch = FeatureBatch(feats[j:j + per_step].reshape(per_step * T, -1), seqs[j:j + per_step].reshape(-1),
                             loss_mask.repeat(per_step), torch.arange(T).repeat(per_step), [T] * per_step)
        out = drafter_loss(drafter, batch, torch.cat([anchors + T * i for i in range(per_step)]), emb, head,
                           attn_backend="sdpa")
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return drafter.eval()


# layer ids per case: the ±1 case exports layer 0 but trains on layer 1; anchor_visible uses the layer
# whose features encode the next token, so the leaked anchor row is a shortcut.
CASES = [("none", [0]), ("shifted_labels", [0]), ("layer_ids_plus_1", [0]), ("anchor_visible", [1])]


@pytest.mark.parametrize("pitfall,layer_ids", CASES, ids=[c[0] for c in CASES])
def test_planted_pitfall_is_flagged(world, pitfall, layer_ids, monkeypatch, tmp_path):
    model, seqs = world
    train_seqs, eval_prompts = seqs[:64], [s[:PROMPT].tolist() for s in seqs[64:68]]
    with planted(pitfall, monkeypatch):
        drafter = train(model, train_seqs, layer_ids)
        export = export_drafter(drafter, tmp_path / "export", {"step": 100})
        # the report: served τ through the real loop (not patched), τ_sim through the training code (patched)
        report = evaluate_export(str(export), prompts=eval_prompts, max_new_tokens=COMPLETION,
                                 loaded_target=(model, None), dtype="float32", out_dir=str(tmp_path / "eval"))
    tau, tau_sim = report["tau"], report["tau_sim"]
    print(f"{pitfall}: tau {tau:.2f} tau_sim {tau_sim:.2f} gap {report['gap']:+.2f} n-gram {report['tau_ngram']:.2f}")
    assert report["lossless"] is True  # whatever the drafter, the output is the target's
    if pitfall == "none":
        # consistent training and serving: τ_sim at the served blocks is the served τ
        assert tau_sim > 2.0 and tau > 2.0 and abs(report["gap"]) < 0.05 and not report["gap_flag"]
    elif pitfall == "anchor_visible":
        # weaker on this target (the drafter also learns the token path): τ drops, τ_sim does not
        assert tau_sim > 2.5 and tau < tau_sim and report["gap_flag"] is True  # measured: gap +0.19
    else:
        assert tau_sim > 2.5, "the broken training still looks good to its own metric"
        assert tau < 0.75 * tau_sim and report["gap_flag"] is True
        assert any(w.startswith("TRAIN/SERVE GAP") for w in report["warnings"])
        assert (tmp_path / "eval" / "report.png").exists()
