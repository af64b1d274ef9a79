"""What one forward step computes: new tokens of several sequences over their block tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence: ids, the position of the first, and the block table.

    The block table covers positions [0, start_pos + len(token_ids)); tokens before
    start_pos must already be in the pool. `need_logits` asks for the last token's logits.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    need_logits: bool = True


@dataclass
class PrefillMeta:
    """Attention inputs of one multi-token chunk."""

    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_len: int  # tokens attended to, the new ones included
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] blocks holding that context
    causal_mask: torch.Tensor | None  # [num_tokens, context_len] bool; None when square causal


@dataclass
class DecodeMeta:
    """Attention inputs of the single-token sequences, batched and padded."""

    num_seqs: int
    block_ids: torch.Tensor  # [num_seqs, max_blocks] (padding points at block 0)
    mask: torch.Tensor | None  # [num_seqs, 1, 1, max_blocks * block_size] bool (True: attend);
    # None for a single sequence, whose K/V is cut to `max_len` instead
    max_len: int  # longest context among the sequences


@dataclass
class ForwardBatch:
    """Flattened inputs of one step: decode sequences first, then prefill chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode: DecodeMeta | None
    prefills: list[PrefillMeta]
    logits_rows: torch.Tensor  # rows of T whose logits are returned, in chunk order
    logits_chunk_index: list[int]  # caller's chunk index of each returned logits row


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size


def build_batch(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Turn per-sequence chunks into the tensors one forward step needs."""
    if not chunks:
        raise ValueError("empty batch")
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
    ids: list[int] = []
    pos_parts: list[torch.Tensor] = []
    slot_parts: list[torch.Tensor] = []
    logits_rows: list[int] = []
    logits_chunk: list[int] = []
    decode_idx = [i for i in order if len(chunks[i].token_ids) == 1]
    prefills: list[PrefillMeta] = []
    tables = {}
    for i in order:
        c = chunks[i]
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("a chunk must carry at least one token")
        end = c.start_pos + n
        if len(c.block_table) * block_size < end:
            raise ValueError("block table too short for the chunk")
        bt = torch.tensor(list(c.block_table), dtype=torch.long)
        tables[i] = bt
        pos = torch.arange(c.start_pos, end, dtype=torch.long)
        row0 = len(ids)
        ids.extend(c.token_ids)
        pos_parts.append(pos)
        slot_parts.append(_slots(bt, pos, block_size))
        if c.need_logits:
            logits_rows.append(row0 + n - 1)
            logits_chunk.append(i)
        if n > 1:
            mask = None
            if c.start_pos > 0:
                mask = torch.arange(end, dtype=torch.long)[None, :] <= pos[:, None]
            used = bt[: -(-end // block_size)]
            prefills.append(PrefillMeta(row0, n, end, used, mask))
    decode = None
    if decode_idx:
        lens = [chunks[i].start_pos + 1 for i in decode_idx]
        max_len = max(lens)
        max_blocks = (max_len + block_size - 1) // block_size
        bt_pad = torch.zeros(len(decode_idx), max_blocks, dtype=torch.long)
        for r, i in enumerate(decode_idx):
            bt = tables[i][:max_blocks]
            bt_pad[r, : bt.shape[0]] = bt
        mask = None
        if len(decode_idx) > 1:
            span = max_blocks * block_size
            valid = torch.arange(span)[None, :] < torch.tensor(lens)[:, None]
            mask = valid[:, None, None, :].to(device)
        decode = DecodeMeta(len(decode_idx), bt_pad.to(device), mask, max_len)
    for p in prefills:
        p.block_ids = p.block_ids.to(device)
        if p.causal_mask is not None:
            p.causal_mask = p.causal_mask.to(device)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.cat(pos_parts).to(device),
        slot_mapping=torch.cat(slot_parts).to(device),
        decode=decode,
        prefills=prefills,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        logits_chunk_index=logits_chunk,
    )
