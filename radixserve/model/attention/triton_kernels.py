# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton reads kernel parameter annotations itself: its kernels stay unannotated.)
"""The Triton kernels of the `triton` attention backend (attention/triton.py), and the two
calls that launch them. Importing this module imports triton.

Both kernels read K/V straight from the pool, [num_blocks, block_size, num_kv_heads, head_dim],
looking block ids up on the device; nothing is gathered or copied per layer.

- Decode (flash-decoding): each (sequence, KV head, context partition) program attends the
  query heads of one GQA group over its slice of the context, and a reduce kernel merges the
  partitions, so one long sequence still fills the GPU. Grids depend only on q.shape and
  block_table.shape, lengths and block ids are read on the device, and scratch is a plain
  `torch.empty` of shape-only size: the decode step can be captured in a CUDA graph.
- Prefill (varlen, causal, over a cached prefix): one launch for all of a step's chunks; a
  host-built tile table (the backend's `plan`) says where each tile of query rows starts.

float16 / bfloat16 / float32 pools; scores, softmax and sums in float32. The kernels run on
CUDA; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before this module
is imported; slow, for tests).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# Decided when the kernels below are decorated (Triton reads the variable at that moment).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_LOG2E = 1.4426950408889634


@triton.jit
def _token_rows(
    head_ptr, table_ptr, pos, ok, d, d_ok, stride_b, stride_s, BLOCK_SIZE: tl.constexpr
):
    """[len(pos), BLOCK_D] rows of one head's K or V (`head_ptr`: the pool at that head) at
    context positions `pos`, their block ids read from `table_ptr` (a block-table row); zeros
    where not `ok`."""
    blk = tl.load(table_ptr + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    off = pos % BLOCK_SIZE
    return tl.load(
        head_ptr + blk[:, None] * stride_b + off[:, None] * stride_s + d[None, :],
        mask=ok[:, None] & d_ok[None, :],
        other=0.0,
    )


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    table_cols,
    num_parts,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PART: tl.constexpr,
    TILE: tl.constexpr,
):
    """Softmax partials (running max, sum, weighted V) of one sequence's GQA group over one
    partition of its context (its keys within the last `window` of the context, where
    window > 0; a partition before the window stores -inf, never read by the reduce)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    num_heads = GROUP * tl.num_programs(1)
    # A length beyond the table's columns (a garbage padding row) must not read past it.
    ctx = tl.minimum(tl.load(lens_ptr + seq), table_cols * BLOCK_SIZE)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the first key attended
    start = part * PART
    end = tl.minimum(start + PART, ctx)
    first = tl.maximum(start, lo // TILE * TILE)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table_row = table_ptr + seq * stride_table
    for t0 in range(first, end, TILE):
        pos = t0 + tl.arange(0, TILE)
        p_ok = (pos < end) & (pos >= lo)
        k = _token_rows(
            k_ptr + kvh * stride_kh, table_row, pos, p_ok, d, d_ok, stride_kb, stride_ks, BLOCK_SIZE
        ).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, TILE]
        scores = tl.where(p_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        v = _token_rows(
            v_ptr + kvh * stride_vh, table_row, pos, p_ok, d, d_ok, stride_vb, stride_vs, BLOCK_SIZE
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    # Partitions past the length store nothing: the reduce reads only the ones it reaches.
    row = (seq * num_heads + heads) * num_parts + part  # [GROUP_PAD]
    live = g_ok & (start + 0 * g < ctx)
    tl.store(max_ptr + row, m, mask=live)
    tl.store(sum_ptr + row, s_sum, mask=live)
    tl.store(
        acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None] & d_ok[None, :]
    )


@triton.jit
def _decode_reduce_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    lens_ptr,
    out_ptr,
    window,
    stride_ot,
    table_cols,
    num_parts,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PART: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Merge one (sequence, head)'s partials into its output row, reading only the
    partitions its length (and window) reaches (a sequence with no context gets zeros)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * num_parts
    ctx = tl.minimum(tl.load(lens_ptr + seq), table_cols * BLOCK_SIZE)
    used = tl.cdiv(ctx, PART)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0) // PART  # the window's
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_run = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(first, used, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        p_ok = p < used
        m = tl.load(max_ptr + base + p, mask=p_ok, other=float("-inf"))
        s = tl.load(sum_ptr + base + p, mask=p_ok, other=0.0)
        part_acc = tl.load(
            acc_ptr + (base + p)[:, None] * HEAD_DIM + d[None, :],
            mask=p_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # finite: a used partition has tokens
        old = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        total = total * old + tl.sum(w * s, axis=0)
        acc = acc * old + tl.sum(part_acc * w[:, None], axis=0)
        m_run = m_new
    o = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), d_ok)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tiles_ptr,
    blocks_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Causal attention of one tile of a chunk's query rows (one head) over the chunk's
    context: the cached prefix and the chunk itself, read through its block ids (with
    window > 0, each row's last `window` keys)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    row0 = tl.load(tiles_ptr + tile * 4)
    num_rows = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    block_off = tl.load(tiles_ptr + tile * 4 + 3)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < num_rows
    d_ok = d < HEAD_DIM
    q_pos = pos0 + r
    q = tl.load(
        q_ptr + (row0 + r)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = pos0 + num_rows  # keys up to the tile's last query position (causal)
    lo = tl.where(window > 0, tl.maximum(pos0 - window + 1, 0), 0) // BLOCK_N * BLOCK_N
    chunk_blocks = blocks_ptr + block_off
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        k = _token_rows(
            k_ptr + kvh * stride_kh, chunk_blocks, k_pos, k_ok, d, d_ok, stride_kb, stride_ks,
            BLOCK_SIZE,
        )  # fmt: skip
        v = _token_rows(
            v_ptr + kvh * stride_vh, chunk_blocks, k_pos, k_ok, d, d_ok, stride_vb, stride_vs,
            BLOCK_SIZE,
        )  # fmt: skip
        if DOT_F32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        causal = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        in_window = (k_pos[None, :] > q_pos[:, None] - window) | (window <= 0)
        causal = causal & in_window
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A row with no key yet in its window (-inf max) weighs nothing, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    o = acc / tl.where(s_sum == 0.0, 1.0, s_sum)[:, None]  # padding rows: 0, not 0 / 0
    tl.store(
        out_ptr + (row0 + r)[:, None] * stride_ot + head * HEAD_DIM + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


def decode_into(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    partition_size: int,
    tile: int,
    scale: float | None = None,
    window: int | None = None,
) -> None:
    """Writes out[:num_seqs] (one row per block-table row) from q[:num_seqs], `partition_size`
    tokens of context per program, `tile` at a time; allocates only the partials, whose sizes
    follow the shapes."""
    num_seqs, cols = block_table.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, block_size = k_blocks.shape[2], k_blocks.shape[1]
    group = num_heads // num_kv
    num_parts = triton.cdiv(cols * block_size, partition_size)
    part_rows = num_seqs * num_heads * num_parts
    acc = torch.empty(part_rows, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(part_rows, dtype=torch.float32, device=q.device)
    s = torch.empty(part_rows, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(num_seqs, num_kv, num_parts)](
        q,
        k_blocks,
        v_blocks,
        block_table,
        context_lens,
        acc,
        m,
        s,
        _LOG2E * (scale if scale is not None else 1 / math.sqrt(head_dim)),
        window or 0,
        q.stride(0),
        q.stride(1),
        k_blocks.stride(0),
        k_blocks.stride(1),
        k_blocks.stride(2),
        v_blocks.stride(0),
        v_blocks.stride(1),
        v_blocks.stride(2),
        block_table.stride(0),
        cols,
        num_parts,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=max(2, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PART=partition_size,
        TILE=tile,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        acc,
        m,
        s,
        context_lens,
        out,
        window or 0,
        out.stride(0),
        cols,
        num_parts,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PART=partition_size,
        CHUNK=min(16, max(2, triton.next_power_of_2(num_parts))),
    )


def prefill_into(
    q: torch.Tensor,
    tiles: torch.Tensor,
    blocks: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    out: torch.Tensor,
    block_m: int,
    block_n: int,
    scale: float | None = None,
    window: int | None = None,
) -> None:
    """Writes the rows of every prefill chunk named in `tiles` (see the backend's `plan`),
    `block_m` query rows by `block_n` keys at a time."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _prefill_kernel[(tiles.shape[0], num_heads)](
        q,
        k_blocks,
        v_blocks,
        out,
        tiles,
        blocks,
        _LOG2E * (scale if scale is not None else 1 / math.sqrt(head_dim)),
        window or 0,
        q.stride(0),
        q.stride(1),
        k_blocks.stride(0),
        k_blocks.stride(1),
        k_blocks.stride(2),
        v_blocks.stride(0),
        v_blocks.stride(1),
        v_blocks.stride(2),
        out.stride(0),
        GROUP=num_heads // k_blocks.shape[2],
        BLOCK_SIZE=k_blocks.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # fp32 pools: exact products (no TF32); the interpreter has no 16-bit dot.
        DOT_F32=q.dtype == torch.float32 or INTERPRETED,
    )
