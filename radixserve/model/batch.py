"""What one forward step computes: new tokens of several sequences over their block tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from radixserve.values import ceil_div


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence: ids, the position of the first, and the block table.

    The block table covers positions [0, start_pos + len(token_ids)); tokens before
    start_pos must already be in the pool. `need_logits` asks for the last token's logits;
    `logits_from` (an offset in the chunk) asks for the logits of every row from it on too
    (to score a prompt), returned in row order before the last row's.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    need_logits: bool = True
    logits_from: int | None = None


@dataclass
class PrefillMeta:
    """Attention inputs of one multi-token chunk."""

    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_len: int  # tokens attended to, the new ones included
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] blocks holding that context

    def causal_mask(self, window: int | None = None) -> torch.Tensor | None:
        """[num_tokens, context_len] bool, on the block ids' device: which keys each new token
        attends to (with `window`, only keys less than `window` positions back); None when
        that is plain square causal (the chunk starts its sequence, within any window).
        Built on demand: backends that read the pool in place never need it."""
        start = self.context_len - self.num_tokens
        if start == 0 and (window is None or window >= self.context_len):
            return None
        device = self.block_ids.device
        pos = torch.arange(start, self.context_len, device=device)[:, None]
        keys = torch.arange(self.context_len, device=device)[None, :]
        mask = keys <= pos
        return mask if window is None else mask & (keys > pos - window)


@dataclass
class DecodeMeta:
    """Attention inputs of the single-token sequences (the first rows of the batch)."""

    num_seqs: int
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]; padding points at block 0
    context_lens: torch.Tensor  # int32 [num_seqs]: tokens attended to, the new one included
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
    block_size: int
    # The same step as the layers whose K/V is in a window pool see it (kv_pool.KVPool):
    # block ids replaced by the slots they hold there (`in_window_pool`); None without one.
    window_view: ForwardBatch | None = None


def in_window_pool(batch: ForwardBatch, slot_of: torch.Tensor, scratch: int) -> ForwardBatch:
    """`batch` addressed in a window pool: `slot_of` [num_blocks + 1] int64 is each block's
    slot there (negative where it has none: such a block is read as slot `scratch`, whose
    keys lie outside every window that reads it, so they are skipped or masked)."""
    bs = batch.block_size

    def slots(block_ids: torch.Tensor) -> torch.Tensor:
        s = slot_of[block_ids.long()]
        return s.masked_fill_(s < 0, scratch)

    d = batch.decode
    mapping = slots(batch.slot_mapping // bs) * bs + batch.slot_mapping % bs
    return replace(
        batch,
        slot_mapping=mapping,
        decode=None if d is None else replace(d, block_table=slots(d.block_table).int()),
        prefills=[replace(p, block_ids=slots(p.block_ids)) for p in batch.prefills],
        window_view=None,
    )


class StepBuffers:
    """Input tensors allocated once and refilled in place every step (a runner's inputs keep
    their addresses, which graph capture needs and which saves allocations everywhere)."""

    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device | str
    ) -> None:
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.block_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        """Whether a step of this size fits the buffers."""
        return (
            num_tokens <= self.input_ids.shape[0]
            and num_seqs <= self.block_table.shape[0]
            and max_blocks <= self.block_table.shape[1]
        )


def _put(buffer: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """`values` copied into the front of `buffer` (a view), or `values` moved to its device."""
    if buffer is None:
        return values
    out = (
        buffer[: values.shape[0]]
        if values.dim() == 1
        else buffer[: values.shape[0], : values.shape[1]]
    )  # noqa: E501
    out.copy_(values, non_blocking=True)
    return out


def build_batch(
    chunks: Sequence[SeqChunk],
    block_size: int,
    device: torch.device | str = "cpu",
    buffers: StepBuffers | None = None,
) -> ForwardBatch:
    """Turn per-sequence chunks into the tensors one forward step needs (in `buffers` when
    given and large enough)."""
    if not chunks:
        raise ValueError("empty batch")
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    logits_chunk: list[int] = []
    decode_idx = [i for i in order if len(chunks[i].token_ids) == 1]
    prefills: list[PrefillMeta] = []
    for i in order:
        c = chunks[i]
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("a chunk must carry at least one token")
        end = c.start_pos + n
        if len(c.block_table) * block_size < end:
            raise ValueError("block table too short for the chunk")
        row0 = len(ids)
        ids.extend(c.token_ids)
        table = c.block_table
        for p in range(c.start_pos, end):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        if c.logits_from is not None:
            first = min(max(0, c.logits_from), n - 1)
        else:
            first = n - 1 if c.need_logits else n
        for r in range(first, n):
            logits_rows.append(row0 + r)
            logits_chunk.append(i)
        if n > 1:
            used = torch.tensor(table[: ceil_div(end, block_size)], dtype=torch.long, device=device)
            prefills.append(PrefillMeta(row0, n, end, used))
    max_blocks = 0
    if decode_idx:
        lens = [chunks[i].start_pos + 1 for i in decode_idx]
        max_blocks = ceil_div(max(lens), block_size)
    if buffers is not None and not buffers.fits(len(ids), len(decode_idx), max_blocks):
        buffers = None
    bufs: StepBuffers | None = buffers
    decode = None
    if decode_idx:
        table_rows = [list(chunks[i].block_table[:max_blocks]) for i in decode_idx]
        padded = [row + [0] * (max_blocks - len(row)) for row in table_rows]
        decode = DecodeMeta(
            len(decode_idx),
            _put(bufs.block_table if bufs else None, torch.tensor(padded, dtype=torch.int32)).to(
                device
            ),
            _put(bufs.context_lens if bufs else None, torch.tensor(lens, dtype=torch.int32)).to(
                device
            ),
            max(lens),
        )

    def put(buffer: torch.Tensor | None, values: list[int]) -> torch.Tensor:
        return _put(buffer, torch.tensor(values, dtype=torch.long)).to(device)

    return ForwardBatch(
        input_ids=put(bufs.input_ids if bufs else None, ids),
        positions=put(bufs.positions if bufs else None, positions),
        slot_mapping=put(bufs.slot_mapping if bufs else None, slots),
        decode=decode,
        prefills=prefills,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        logits_chunk_index=logits_chunk,
        block_size=block_size,
    )


def narrow_to_outputs(batch: ForwardBatch) -> tuple[torch.Tensor, ForwardBatch] | None:
    """The rows whose last-layer output is used (every decode row, the last row of each
    prefill chunk that returns logits) and the batch restricted to them, each such prefill
    row a one-token chunk over its full context; None where that is every row. The last
    decoder layer needs the other rows only for their K/V."""
    b = batch.decode.num_seqs if batch.decode is not None else 0
    keep = list(range(b))
    wanted = set(batch.logits_rows.tolist())
    prefills = []
    for p in batch.prefills:
        last = p.token_start + p.num_tokens - 1
        if any(p.token_start <= r < last for r in wanted):
            return None  # a chunk scores its prompt: the last layer needs those rows too
        if last in wanted:
            prefills.append(PrefillMeta(len(keep), 1, p.context_len, p.block_ids))
            keep.append(last)
    if len(keep) == batch.input_ids.shape[0]:
        return None
    rows = torch.tensor(keep, dtype=torch.long, device=batch.input_ids.device)
    narrow = ForwardBatch(
        input_ids=batch.input_ids[rows],
        positions=batch.positions[rows],
        slot_mapping=batch.slot_mapping[rows],
        decode=batch.decode,
        prefills=prefills,
        logits_rows=torch.searchsorted(rows, batch.logits_rows),  # keep is ascending
        logits_chunk_index=batch.logits_chunk_index,
        block_size=batch.block_size,
    )
    if batch.window_view is not None:
        narrowed = narrow_to_outputs(batch.window_view)
        assert narrowed is not None  # the same rows as `batch`'s
        narrow.window_view = narrowed[1]
    return rows, narrow
