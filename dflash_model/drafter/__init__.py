"""DFlash drafter math, importable alone (torch only): model, anchors, mask, loss, export, drafting.

See docs/drafter.md. Typical training step on one packed row::

    model = DFlashDrafter(target_config, num_layers=5, block_size=16, mask_token_id=151669)
    batch = FeatureBatch(features, input_ids, loss_mask, position_ids, doc_lengths)
    anchors = sample_anchors(loss_mask, doc_lengths, 512, generator)
    out = drafter_loss(model, batch, anchors, embed_weight, lm_head_weight)
    out.loss.backward()
"""

from dflash_model.drafter.anchors import (anchor_candidates, block_labels, build_blocks, doc_ids_from_lengths,
                                         sample_anchor_shares, sample_anchors, slot_weights)
from dflash_model.drafter.batch import FeatureBatch
from dflash_model.drafter.config import DrafterConfig, default_gamma, pick_mask_token_id
from dflash_model.drafter.draft import draft_block, draft_blocks
from dflash_model.drafter.export import export_drafter, export_tensor_names, load_drafter, read_export_config
from dflash_model.drafter.flops import H200_BF16_PEAK, training_flops
from dflash_model.drafter.layers import default_target_layer_ids, from_aux_layer_ids, to_aux_layer_ids
from dflash_model.drafter.loss import LossOutput, drafter_loss, tau_serve, tau_sim
from dflash_model.drafter.mask import BlockLayout
from dflash_model.drafter.model import DFlashDrafter

__all__ = [
    "DFlashDrafter", "DrafterConfig", "BlockLayout", "FeatureBatch", "LossOutput",
    "default_target_layer_ids", "to_aux_layer_ids", "from_aux_layer_ids",
    "sample_anchors", "sample_anchor_shares", "anchor_candidates", "block_labels", "build_blocks",
    "doc_ids_from_lengths",
    "slot_weights", "default_gamma", "pick_mask_token_id", "tau_sim", "tau_serve",
    "drafter_loss", "draft_block", "draft_blocks", "export_drafter", "load_drafter", "read_export_config",
    "export_tensor_names", "training_flops", "H200_BF16_PEAK",
]
