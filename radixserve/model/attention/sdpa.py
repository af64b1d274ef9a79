"""`--attention-backend sdpa`: gather each sequence's blocks, then torch's
scaled_dot_product_attention. Runs anywhere; the fallback of `auto`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.model.attention.base import (
    AttentionPlan,
    BackendCapabilities,
    gather_blocks,
    prefill_attention,
)
from radixserve.model.batch import ForwardBatch


class SdpaBackend:
    """Gathers each sequence's blocks and runs torch SDPA; any device, any dtype (K/V stored
    in another dtype than the model's are converted after the gather)."""

    name = "sdpa"
    capabilities = BackendCapabilities(
        devices=None,
        dtypes=None,
        kv_dtypes=None,
        reads_pool_in_place=False,
        fused_decode_step=False,
        narrows_last_layer=True,
        graph_capturable=True,
    )

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """None: torch's SDPA runs everywhere."""
        return None

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
        """The decode rows' block ids, and their context mask when there are several."""
        d = batch.decode
        if d is None:
            return AttentionPlan()
        block_ids = d.block_table.long()
        mask = None
        if d.num_seqs > 1:  # one sequence: its K/V is cut to max_len instead of masked
            mask = _context_mask(block_ids, batch.block_size, d.context_lens)
        return AttentionPlan(block_ids, mask)

    def forward(
        self,
        q: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H * D]: decode rows over their gathered blocks, then prefills;
        a window masks the keys it leaves out."""
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        d = batch.decode
        if d is not None:
            assert plan.decode_block_ids is not None
            b = d.num_seqs
            keys: tuple[int, int] | None = None
            mask = plan.decode_mask
            if mask is None:  # one sequence: its keys cut to the context (and window)
                keys = (0 if window is None else max(0, d.max_len - window), d.max_len)
            elif window is not None:
                if window not in plan.window_masks:
                    plan.window_masks[window] = _context_mask(
                        plan.decode_block_ids, batch.block_size, d.context_lens, window
                    )
                mask = plan.window_masks[window]
            out[:b] = _sdpa_decode(
                q[:b], k_blocks, v_blocks, plan.decode_block_ids, mask, keys, scale
            )
        prefill_attention(q, batch, k_blocks, v_blocks, out, window, scale)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """The tensors-only decode entry (AttentionBackend.decode): capturable."""
        block_ids = block_table.long()
        mask = _context_mask(block_ids, k_blocks.shape[1], context_lens, window)
        return _sdpa_decode(q, k_blocks, v_blocks, block_ids, mask, None, scale)


def _context_mask(
    block_ids: torch.Tensor,
    block_size: int,
    context_lens: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """bool [B, 1, 1, W * block_size]: which gathered key slots of each sequence its new
    token attends to: its context, or the last `window` tokens of it."""
    span = torch.arange(block_ids.shape[1] * block_size, device=block_ids.device)[None, :]
    lens = context_lens.long()[:, None]
    mask = span < lens
    if window is not None:
        mask &= span >= lens - window
    return mask[:, None, None, :]


def _sdpa_decode(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor | None,
    keys: tuple[int, int] | None,
    scale: float | None,
) -> torch.Tensor:
    """q [B, H, D] over the gathered blocks `block_ids` [B, W], keys masked by `mask`
    [B, 1, 1, W * BS] or cut to the range `keys` -> [B, H * D]."""
    b, num_heads, head_dim = q.shape
    num_kv = k_blocks.shape[2]
    # One query token per sequence: fold the query heads sharing a KV head into the
    # query-length axis, so no K/V repeat is needed.
    qd = q.reshape(b, num_kv, num_heads // num_kv, head_dim)
    kd = gather_blocks(k_blocks, block_ids).view(b, -1, num_kv, head_dim)
    vd = gather_blocks(v_blocks, block_ids).view(b, -1, num_kv, head_dim)
    if keys is not None:
        kd, vd = kd[:, keys[0] : keys[1]], vd[:, keys[0] : keys[1]]
    kd, vd = kd.to(q.dtype).transpose(1, 2), vd.to(q.dtype).transpose(1, 2)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return od.reshape(b, num_heads * head_dim)
