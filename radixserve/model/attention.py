"""Attention backends over the paged KV pool: plan a step's metadata once, then attend per
layer. `sdpa` (torch's scaled_dot_product_attention over gathered blocks) runs anywhere;
`cpu` reads decode K/V from the pool in place with our kernel; `triton` (attention_triton.py)
reads it in place on CUDA. `select_backend` picks one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from radixserve.model import kernels
from radixserve.model.batch import ForwardBatch
from radixserve.values import ATTENTION_BACKENDS


@dataclass
class AttentionPlan:
    """Per-step tensors a backend derives once from the batch and reuses in every layer."""

    decode_block_ids: torch.Tensor | None = None  # long [num_seqs, max_blocks]
    decode_mask: torch.Tensor | None = None  # bool [num_seqs, 1, 1, span] (batch > 1)


class AttentionBackend(Protocol):
    """Attention of a step's queries over the paged pool (this step's K/V already written)."""

    name: str

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
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H * D]; k/v_blocks are one layer's pool [NB, BS, KVH, D]."""
        ...

    def decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per sequence: q [B, H, D] -> [B, H * D], sequence b attending to
        its first context_lens[b] tokens through block_table[b] (int32 [B, W], any width
        covering the contexts). Tensors only, no host sync and no shape that depends on
        their values, so compiled steps and captured graphs can call it."""
        ...


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
) -> None:
    """Each multi-token chunk's queries over its gathered context, causal (torch SDPA)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_blocks.shape[2]
    for p in batch.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        kp = gather_blocks(k_blocks, p.block_ids).view(-1, num_kv, head_dim)[: p.context_len]
        vp = gather_blocks(v_blocks, p.block_ids).view(-1, num_kv, head_dim)[: p.context_len]
        kp = kp.to(q.dtype).transpose(0, 1).unsqueeze(0)  # a --kv-cache-dtype pool: upcast
        vp = vp.to(q.dtype).transpose(0, 1).unsqueeze(0)
        mask = p.causal_mask()
        if mask is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
        out[rows] = op.squeeze(0).transpose(0, 1).reshape(p.num_tokens, num_heads * head_dim)


class SdpaBackend:
    """Gathers each sequence's blocks and runs torch SDPA; any device, any dtype (K/V stored
    in another dtype than the model's are converted after the gather)."""

    name = "sdpa"

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
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
    ) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        d = batch.decode
        if d is not None:
            assert plan.decode_block_ids is not None
            b = d.num_seqs
            max_len = None if plan.decode_mask is not None else d.max_len
            out[:b] = _sdpa_decode(
                q[:b], k_blocks, v_blocks, plan.decode_block_ids, plan.decode_mask, max_len
            )
        prefill_attention(q, batch, k_blocks, v_blocks, out)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        block_ids = block_table.long()
        mask = _context_mask(block_ids, k_blocks.shape[1], context_lens)
        return _sdpa_decode(q, k_blocks, v_blocks, block_ids, mask, None)


def _context_mask(
    block_ids: torch.Tensor, block_size: int, context_lens: torch.Tensor
) -> torch.Tensor:
    """bool [B, 1, 1, W * block_size]: which gathered key slots of each sequence are context."""
    span = torch.arange(block_ids.shape[1] * block_size, device=block_ids.device)
    return (span[None, :] < context_lens.long()[:, None])[:, None, None, :]


def _sdpa_decode(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor | None,
    max_len: int | None,
) -> torch.Tensor:
    """q [B, H, D] over the gathered blocks `block_ids` [B, W], keys masked by `mask`
    [B, 1, 1, W * BS] or cut to `max_len` -> [B, H * D]."""
    b, num_heads, head_dim = q.shape
    num_kv = k_blocks.shape[2]
    # One query token per sequence: fold the query heads sharing a KV head into the
    # query-length axis, so no K/V repeat is needed.
    qd = q.reshape(b, num_kv, num_heads // num_kv, head_dim)
    kd = gather_blocks(k_blocks, block_ids).view(b, -1, num_kv, head_dim)
    vd = gather_blocks(v_blocks, block_ids).view(b, -1, num_kv, head_dim)
    if max_len is not None:
        kd, vd = kd[:, :max_len], vd[:, :max_len]
    kd, vd = kd.to(q.dtype).transpose(1, 2), vd.to(q.dtype).transpose(1, 2)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
    return od.reshape(b, num_heads * head_dim)


class CpuPagedBackend:
    """Attention by our kernels, straight from the pool's blocks (no per-layer copy of each
    sequence's context): decode rows, and prefill chunks causal over their cached prefix
    (head sizes that are not a multiple of 16 take `sdpa`'s prefill). float32 models on CPU,
    K/V stored in float32, bfloat16 or float16 (converted to float32 as they are read)."""

    name = "cpu"

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
        return AttentionPlan()

    def forward(
        self,
        q: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        d = batch.decode
        if d is not None and not batch.prefills:  # a decode step: no copy into a wider out
            return self.decode(q, k_blocks, v_blocks, d.block_table, d.context_lens)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
        if d is not None:
            b = d.num_seqs
            out[:b] = self.decode(q[:b], k_blocks, v_blocks, d.block_table, d.context_lens)
        if head_dim % 16:
            prefill_attention(q, batch, k_blocks, v_blocks, out)
            return out
        scale = 1.0 / math.sqrt(head_dim)
        for p in batch.prefills:
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            kernels.op("paged_prefill_attention")(
                q[rows], k_blocks, v_blocks, p.block_ids, p.context_len, scale, out[rows]
            )
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        b, num_heads, head_dim = q.shape
        out = torch.empty(b, num_heads, head_dim, dtype=q.dtype, device=q.device)
        kernels.op("paged_decode_attention")(
            q,
            k_blocks,
            v_blocks,
            block_table,
            context_lens,
            1.0 / math.sqrt(head_dim),
            out,
        )
        return out.view(b, num_heads * head_dim)


def triton_unavailable(device: torch.device) -> str | None:
    """Why the `triton` backend cannot run on `device` here (None when it can); imports
    triton, so call it only when that backend is asked for or CUDA is in use."""
    try:
        from radixserve.model import attention_triton
    except ImportError as e:
        return f"it needs the triton package ({e}); pip install 'radixserve[gpu]'"
    return attention_triton.unavailable_reason(device)


def kv_dtype_problem(
    name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype
) -> str | None:
    """Why backend `name` cannot attend over K/V stored in `kv_dtype` for a `dtype` model
    (None when it can): the triton kernels read K/V in the model dtype only."""
    if kv_dtype == dtype:
        return None
    if name == "triton" or (
        name == "auto" and device.type == "cuda" and triton_unavailable(device) is None
    ):
        model, kv = (str(t).removeprefix("torch.") for t in (dtype, kv_dtype))
        return (
            f"the triton attention backend reads K/V in the model dtype ({model}) only; "
            f"--kv-cache-dtype {kv} needs --attention-backend sdpa"
        )
    return None


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend `name` asks for, for a `dtype` model whose K/V pool holds `kv_dtype`
    (default: `dtype`). `auto` is `triton` on CUDA where triton imports; `cpu` for float32
    models on the CPU when our kernels load (at 2k-token contexts 4x faster than gathering
    for SDPA, and it needs no padding to the longest sequence of a batch); otherwise `sdpa`.
    Raises ValueError for a backend this setup cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {ATTENTION_BACKENDS}")
    kv_dtype = kv_dtype or dtype
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        reason = triton_unavailable(device)
        if reason is None:
            problem = kv_dtype_problem("triton", device, dtype, kv_dtype)
            if problem:
                raise ValueError(problem)
            from radixserve.model.attention_triton import TritonPagedBackend

            return TritonPagedBackend()
        if name == "triton":
            raise ValueError(f"--attention-backend triton cannot run here: {reason}")
    cpu_ok = device.type == "cpu" and dtype == torch.float32
    if name == "cpu":
        if not cpu_ok:
            raise ValueError("--attention-backend cpu runs float32 models on the CPU only")
        if not kernels.load():
            raise ValueError("--attention-backend cpu needs radixserve's CPU kernels")
        return CpuPagedBackend()
    if name == "auto" and cpu_ok and kernels.load():
        return CpuPagedBackend()
    return SdpaBackend()
