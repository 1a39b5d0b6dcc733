"""Our DFlash loss against SpecForge's on the same weights, document, features and anchors (CPU, fp32).

    python benchmarks/specforge_parity.py --specforge /path/to/SpecForge

SpecForge's draft model is built at a small random shape and its weights are loaded into our drafter
(a strict load: the z-lab names). SpecForge's ``OnlineDFlashModel`` draws the anchors and computes its
loss; ``drafter_loss`` then runs on the same anchors. Prints, for several seeds and documents, both
losses, accuracies and the largest difference of the gradients of every trainable weight: equal
figures mean the two trainers optimize the same function, so any difference in the drafters they
make comes from how they train it (steps, batches, lr, initialization), not from the maths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.specforge_train import import_specforge  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specforge", required=True, help="path of a SpecForge checkout")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    family, draft_mod, _ = import_specforge(args.specforge)
    from dflash_model.drafter import DFlashDrafter, DrafterConfig, FeatureBatch, drafter_loss

    torch.set_default_dtype(torch.float32)
    cfg = DrafterConfig.from_target(dict(model_type="qwen3", hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, vocab_size=1000, rope_theta=10000.0),
                                    num_layers=2, block_size=8, target_layer_ids=[1, 3, 5], mask_token_id=999)
    gamma = 4.0
    print(f"{'seed':>4} {'T':>4} {'anchors':>7} {'loss SpecForge':>14} {'loss ours':>10} {'acc SF':>7} "
          f"{'acc ours':>8} {'max |Δgrad| / max |grad|':>24}")
    worst = 0.0
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        T, prompt = 40 + 7 * seed, 9 + seed
        qc = draft_mod.Qwen3Config(**cfg.to_export_dict())
        qc._attn_implementation = "sdpa"
        theirs = draft_mod.DFlashDraftModel(qc).float()
        for p in theirs.parameters():  # its initialization leaves norms at 1: perturb them too
            p.data.add_(0.05 * torch.randn_like(p))
        ours = DFlashDrafter(cfg, attn_backend="sdpa")
        ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if not k.startswith("rotary_emb.")},
                             strict=True)
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
        head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.1
        ids = torch.randint(0, 998, (T,))
        mask = torch.cat([torch.zeros(prompt), torch.ones(T - prompt)])
        feats = torch.randn(T, len(cfg.target_layer_ids) * cfg.hidden_size)

        model = family.OnlineDFlashModel(
            draft_model=theirs, target_lm_head=torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False),
            target_embed_tokens=torch.nn.Embedding.from_pretrained(embed), mask_token_id=cfg.mask_token_id,
            block_size=cfg.block_size, attention_backend="sdpa", num_anchors=12, loss_decay_gamma=gamma)
        model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
        state = torch.random.get_rng_state()
        anchors, keep = model._sample_anchor_positions(T, mask[None], torch.device("cpu"))
        torch.random.set_rng_state(state)  # forward draws the same anchors again
        loss_sf, acc_sf, _ = model(input_ids=ids[None], hidden_states=feats[None], loss_mask=mask[None])
        loss_sf.backward()

        out = drafter_loss(ours, FeatureBatch(feats, ids, mask, torch.arange(T), [T]), anchors[0][keep[0]], embed,
                           head, gamma=gamma, attn_backend="sdpa")
        out.loss.backward()
        grads_sf = dict(theirs.named_parameters())
        rel = max(float((p.grad - grads_sf[n].grad).abs().max() / grads_sf[n].grad.abs().max().clamp_min(1e-30))
                  for n, p in ours.named_parameters())
        l_sf, l_ours = float(loss_sf.detach()), float(out.loss.detach())
        worst = max(worst, rel, abs(l_sf - l_ours) / abs(l_sf))
        print(f"{seed:>4} {T:>4} {int(keep.sum()):>7} {l_sf:>14.6f} {l_ours:>10.6f} "
              f"{float(acc_sf):>7.4f} {float(out.acc):>8.4f} {rel:>24.2e}")
    print(f"largest relative difference (loss or gradient): {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
