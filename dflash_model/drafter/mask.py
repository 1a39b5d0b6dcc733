"""The training attention mask: ONE mask function, two backends (flex block mask, dense SDPA mask).

KV sequence = [context T ; blocks N*B]; queries = the N*B block slots. A query in block j (anchor
row a_j, document d_j) sees
  * context row kv iff doc(kv) == d_j and kv < a_j (strictly before the anchor; the anchor itself
    is slot 0 of the block), and, in sliding layers, (a_j + slot) - kv < window;
  * the B slots of its own block: all of them in full layers, slots <= its own in sliding layers
    (and within the window);
  * nothing of other blocks or of padding (context rows with doc id -1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_model.fast.flex import TILE  # flex_attention's default BlockMask tile (tuned there)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BlockLayout:
    """Where the blocks sit in the row: what the mask function needs, nothing else.

    ctx_doc: [T] document id of each context row (-1 = padding).
    block_doc: [N] document of each block; block_start: [N] anchor row (context must be < it).
    """

    ctx_doc: torch.Tensor
    block_doc: torch.Tensor
    block_start: torch.Tensor
    block_size: int

    @property
    def num_context(self) -> int:
        return int(self.ctx_doc.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.block_doc.shape[0])

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.num_context + self.q_len

    def mask_mod(self, sliding_window: int | None = None) -> MaskMod:
        """flex_attention-style ``(b, h, q_idx, kv_idx) -> bool``; also works on broadcast tensors.

        Indices are clamped so that padded q/kv indices (flex rounds lengths up to its block size)
        never index out of range; padded rows see nothing real and are discarded anyway.
        """
        T, B, N = self.num_context, self.block_size, self.num_blocks
        # one trailing -1 so that a clamped kv >= T looks up "padding"
        ctx_doc = torch.cat([self.ctx_doc, self.ctx_doc.new_full((1,), -1)])
        block_doc, block_start = self.block_doc, self.block_start

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            blk = (q_idx // B).clamp(max=N - 1)
            slot = q_idx % B
            start = block_start[blk]
            is_ctx = kv_idx < T
            ctx_ok = is_ctx & (ctx_doc[kv_idx.clamp(max=T)] == block_doc[blk]) & (kv_idx < start)
            kv_blk = (kv_idx - T) // B
            kv_slot = (kv_idx - T) % B
            blk_ok = ~is_ctx & (kv_blk == blk)
            if sliding_window is not None:
                ctx_ok = ctx_ok & (start + slot - kv_idx < sliding_window)
                blk_ok = blk_ok & (kv_slot <= slot) & (slot - kv_slot < sliding_window)
            return ctx_ok | blk_ok

        return mask_mod

    def dense_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[Q, T + Q] bool (True = attend), from the same mask function, for SDPA."""
        dev = self.block_doc.device
        q = torch.arange(self.q_len, device=dev)[:, None]
        kv = torch.arange(self.kv_len, device=dev)[None, :]
        zero = torch.zeros((), dtype=torch.long, device=dev)
        return self.mask_mod(sliding_window)(zero, zero, q, kv)

    def flex_block_mask(self, sliding_window: int | None = None, compile: bool = True,
                        tile: int = TILE):  # -> BlockMask
        """A flex_attention BlockMask of the same mask function, in ``tile`` x ``tile`` blocks.

        Full attention: built from per-block counts (``_visible_counts``), equal to what
        ``create_block_mask`` makes from the dense [Q, KV] grid. That grid is far larger, and
        compiling its construction dominated the drafter's cold first step (it unrolls a sort
        over the row's tiles), so it is not used here. Sliding layers go through
        ``create_block_mask`` (compiled on CUDA)."""
        from torch.nn.attention.flex_attention import create_block_mask

        dev = self.block_doc.device
        if sliding_window is not None:
            return create_block_mask(self.mask_mod(sliding_window), None, None, self.q_len, self.kv_len,
                                     device=dev, BLOCK_SIZE=tile, _compile=compile and dev.type == "cuda")
        return block_mask_from_counts(self._visible_counts(tile), (tile, tile), self.mask_mod(),
                                      (self.q_len, self.kv_len))

    def _visible_counts(self, tile: int) -> torch.Tensor:
        """[Q, KV tiles] int32: how many keys of each ``tile``-wide KV tile each query sees, for the
        full-attention mask. A query sees the same keys as every other slot of its block, so the
        per-block counts [N, KV tiles] are computed once and repeated B times."""
        T, B, N = self.num_context, self.block_size, self.num_blocks
        dev = self.block_doc.device
        n_kv = -(-self.kv_len // tile)
        visible = torch.zeros(N, n_kv * tile, dtype=torch.bool, device=dev)
        before_anchor = torch.arange(T, device=dev)[None, :] < self.block_start[:, None]
        visible[:, :T] = (self.ctx_doc[None, :] == self.block_doc[:, None]) & before_anchor
        slot_block = torch.arange(N * B, device=dev) // B  # each block sees its own B slots
        # (a comparison, not ``visible[i, j] = True``: a Python scalar assigned by index is copied
        # from pageable host memory, which waits for the GPU and stalls the host every step)
        visible[:, T:T + N * B] = slot_block[None, :] == torch.arange(N, device=dev)[:, None]
        return visible.view(N, n_kv, tile).sum(-1, dtype=torch.int32).repeat_interleave(B, dim=0)

    def attended_pairs(self, sliding_window: int | None = None) -> int:
        """Number of True entries of the mask (the P of docs/drafter.md's FLOP model), without building it."""
        B, ctx = self.block_size, self.ctx_doc
        if self.num_context:  # context rows of the anchor's document strictly before the anchor
            starts = _doc_starts(ctx)
            run = (torch.searchsorted(starts, self.block_start, right=True) - 1).clamp(min=0)
            before = (self.block_start - starts[run]).clamp(min=0)
        else:
            before = torch.zeros_like(self.block_start)
        if sliding_window is None:
            return int(before.sum()) * B + self.num_blocks * B * B
        slot = torch.arange(B, device=ctx.device)
        visible = torch.minimum(before[:, None], (sliding_window - 1 - slot).clamp(min=0)[None, :])
        in_block = torch.minimum(slot + 1, torch.full_like(slot, sliding_window))
        return int(visible.sum()) + self.num_blocks * int(in_block.sum())


def block_mask_from_counts(counts: torch.Tensor, block_size: tuple[int, int], mask_mod: MaskMod,
                           seq_lengths: tuple[int, int]):  # -> BlockMask
    """A BlockMask from ``counts`` [Q, KV tiles]: how many keys of each KV tile each query row sees.

    For masks whose counts come cheaper than evaluating ``mask_mod`` on the whole [Q, KV] grid.
    A tile is full when every one of its query rows sees all of its keys, partial when some row
    sees some; rows past Q (the last tile's padding) see nothing, as in ``create_block_mask``,
    whose form the result takes (counts, then the tiles listed first in ascending order)."""
    from torch.nn.attention.flex_attention import BlockMask

    tq, tkv = block_size
    n_q = -(-counts.shape[0] // tq)
    per_tile = torch.cat([counts, counts.new_zeros(n_q * tq - counts.shape[0], counts.shape[1])])
    per_tile = per_tile.view(n_q, tq, -1)
    full = per_tile.amin(1) == tkv
    partial = (per_tile.amax(1) > 0) & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = tiles[None, None]
        return (tiles.sum(-1, dtype=torch.int32),
                torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32))

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)


def _doc_starts(ctx_doc: torch.Tensor) -> torch.Tensor:
    """Row index where each run of equal doc ids starts (ascending)."""
    change = torch.ones_like(ctx_doc, dtype=torch.bool)
    change[1:] = ctx_doc[1:] != ctx_doc[:-1]
    return change.nonzero().squeeze(1)
