"""What every attention backend is: the protocol, the step plan, what a backend can do
(`BackendCapabilities`), a layer's view of it (`planned`), and the SDPA prefill and block
gather that several backends share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from radixserve.model.batch import ForwardBatch


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend serves and which of the model's forward paths it allows.

    `devices`, `dtypes` and `kv_dtypes` say where `auto` may pick it (None: any); a pool in
    the model's own dtype is always readable, `kv_dtypes` names the others it reads.
    """

    devices: tuple[str, ...] | None  # device types (torch.device.type)
    dtypes: tuple[torch.dtype, ...] | None  # model dtypes
    kv_dtypes: tuple[torch.dtype, ...] | None  # K/V pool dtypes besides the model's
    reads_pool_in_place: bool  # no per-layer copy of each sequence's blocks (auto prefers it)
    fused_decode_step: bool  # a decode-only step may run every layer in one `decode_layers` call
    narrows_last_layer: bool  # its plan depends only on the batch's description (see the model)
    graph_capturable: bool  # `decode` may be captured in a CUDA graph
    sliding_window: bool = True  # attends within a layer's window (`window=`) exactly

    def serves(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether `auto` may pick this backend for a `dtype` model on `device`."""
        return (self.devices is None or device.type in self.devices) and (
            self.dtypes is None or dtype in self.dtypes
        )

    def reads_kv(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether it attends over K/V stored in `kv_dtype` for a `dtype` model."""
        return kv_dtype == dtype or self.kv_dtypes is None or kv_dtype in self.kv_dtypes


@dataclass
class AttentionPlan:
    """Per-step tensors a backend derives once from the batch and reuses in every layer."""

    decode_block_ids: torch.Tensor | None = None  # long [num_seqs, max_blocks]
    decode_mask: torch.Tensor | None = None  # bool [num_seqs, 1, 1, span] (batch > 1)
    # decode_mask's keys limited to each sequence's last `window` tokens, by window (built on
    # a windowed layer's first use in the step, then shared by the layers with that window).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class AttentionBackend(Protocol):
    """Attention of a step's queries over the paged pool (this step's K/V already written)."""

    name: str
    capabilities: BackendCapabilities

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why `--attention-backend <name>` cannot run a `dtype` model on `device` here, as the
        rest of that sentence ("cannot run here: ..."); None when it can."""
        ...

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
        """Derive the step's attention metadata (once per step, before the layers)."""
        ...

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
        """q [T, H, D] -> [T, H * D]; k/v_blocks are one layer's pool [NB, BS, KVH, D]. A
        query at position p attends keys (p - window, p] (with `window`; else [0, p]), with
        softmax scale `scale` (default 1/sqrt(D))."""
        ...

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
        """One query token per sequence: q [B, H, D] -> [B, H * D], sequence b attending to
        its first context_lens[b] tokens (the last `window` of them with a window) through
        block_table[b] (int32 [B, W], any width covering the contexts). Tensors only, no host
        sync and no shape that depends on their values, so compiled steps and captured graphs
        can call it."""
        ...


# A layer's attention: its queries [T, H, D] over its K/V blocks, within its window (None:
# the whole context), at its softmax scale -> [T, H * D].
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None, float], torch.Tensor]


def planned(backend: AttentionBackend, batch: ForwardBatch) -> AttendFn:
    """`backend`'s attention over `batch`'s rows for every layer, the step planned once."""
    plan = backend.plan(batch)

    def attend(
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        return backend.forward(q, batch, plan, k_blocks, v_blocks, window, scale)

    return attend


def gather_blocks(layer_blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the blocks `block_ids` [...] of one layer's K or V out of the pool.

    Returns [..., block_size, num_kv_heads, head_dim]. Whole blocks are copied as raw
    rows; 16-bit types go through an int16 view because indexing bfloat16 tensors
    directly takes a slow path on CPU (hundreds of times slower in torch 2.13).
    """
    nb = layer_blocks.shape[0]
    rows = layer_blocks.view(nb, -1)
    if rows.element_size() == 2:
        rows = rows.view(torch.int16)
    out = rows.index_select(0, block_ids.reshape(-1)).view(layer_blocks.dtype)
    return out.view(*block_ids.shape, *layer_blocks.shape[1:])


def prefill_attention(
    q: torch.Tensor,
    batch: ForwardBatch,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    out: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
) -> None:
    """Each multi-token chunk's queries over its gathered context, causal (within `window`
    with one), by torch SDPA at softmax scale `scale`; writes the chunks' rows of `out`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_blocks.shape[2]
    for p in batch.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        kp = gather_blocks(k_blocks, p.block_ids).view(-1, num_kv, head_dim)[: p.context_len]
        vp = gather_blocks(v_blocks, p.block_ids).view(-1, num_kv, head_dim)[: p.context_len]
        kp = kp.to(q.dtype).transpose(0, 1).unsqueeze(0)  # a --kv-cache-dtype pool: upcast
        vp = vp.to(q.dtype).transpose(0, 1).unsqueeze(0)
        mask = p.causal_mask(window)
        if mask is None:
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, enable_gqa=True, scale=scale
            )
        else:
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, enable_gqa=True, scale=scale
            )
        out[rows] = op.squeeze(0).transpose(0, 1).reshape(p.num_tokens, num_heads * head_dim)
