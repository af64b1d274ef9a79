"""The ModelRunner: everything an engine does on the device, behind one call per step.

It owns the model, the paged KV pool, the step's input buffers (allocated once, refilled in
place), the attention backend, and batched sampling. The engine hands it the step's rows
(StepRow: a span of a sequence's tokens and what to draw from it); it fills in the tokens.

On CUDA, steps where every sequence decodes one token replay CUDA graphs captured per
batch-size bucket over the runner's buffers, unless `enforce_eager`. On CPU every step runs
eagerly: the layers' elementwise steps are fused in radixserve's kernels instead (see
docs/cpu.md: torch.compile measured slower or far too slow to compile on the 2-core CPUs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.cache.window import WindowSlots
from radixserve.model import kernels
from radixserve.model.attention import CpuPagedBackend, select_backend
from radixserve.model.batch import (
    ForwardBatch,
    SeqChunk,
    StepBuffers,
    build_batch,
    in_window_pool,
)
from radixserve.model.decoder import DecoderModel
from radixserve.model.kv_pool import KVPool
from radixserve.model.sampling import SamplingRow, TokenLogprobs, sample_rows, token_logprobs
from radixserve.values import ceil_div


@dataclass(frozen=True)
class ScoreRows:
    """Score a chunk's rows from its `logits_from` on: row j's log-prob of `target_ids[j]`
    (the token after it) and its `num_top` most likely tokens. A sampling chunk's last row is
    scored through its sampled token instead, so `target_ids` may stop one row short."""

    target_ids: Sequence[int]
    num_top: int = 0


@dataclass
class StepRow:
    """One row of a step: a span of one sequence's tokens to compute, what to draw from its
    logits, and (filled by ModelRunner.run) what the step gave it.

    `sampling` says how its token is drawn where `span.need_logits` (None: greedy);
    `keep_logits` returns that logits row too, and `score` the log-probs of its prompt rows.
    Speculative verification: `draft` not None says the next row of the step is the next
    position of this row's sequence, carrying the drafted token `draft`; that row then gets
    a token only if this one got one and it equals `draft`."""

    span: SeqChunk
    sampling: SamplingRow | None = None
    keep_logits: bool = False
    score: ScoreRows | None = None
    draft: int | None = None
    token_id: int | None = None  # the token drawn, where one was
    logits: torch.Tensor | None = None  # [V] float32, with keep_logits
    logprobs: TokenLogprobs | None = None  # the drawn token's, where `sampling` asks
    scores: list[TokenLogprobs] = field(default_factory=list)  # one per `score` target


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 8 up to
    `max_num_seqs` (which is always the last); a batch runs in the smallest that holds it."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences, or None when none does."""
    for size in buckets:
        if size >= num_seqs:
            return size
    return None


class ModelRunner:
    """Runs forward steps of `model` over a KV pool of `num_blocks` x `block_size` tokens."""

    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
        window: WindowSlots | None = None,
    ) -> None:
        p = next(model.parameters())
        self.model = model
        self.device, self.dtype = p.device, p.dtype
        self.kv_dtype = kv_cache_dtype or self.dtype
        self.block_size = block_size
        slots = window.num_slots if window is not None else None
        self.kv_pool = KVPool(
            model.config, num_blocks, block_size, self.kv_dtype, self.device, slots
        )
        # With sliding-window layers in a window pool: each block's slot there, as the cache's
        # WindowSlots keeps it (a view of its array, current at every step).
        self.window = window
        self._slot_of = (
            torch.frombuffer(window.slot_array, dtype=torch.int64) if window is not None else None
        )
        windowed = model.config.sliding_window is not None
        self.attn = select_backend(
            attention_backend, self.device, self.dtype, self.kv_dtype, windowed
        )
        if isinstance(self.attn, CpuPagedBackend):  # prefill attention on the model's path
            self.attn.prefill_path = model.prefill_path
        max_len = max_model_len or model.config.max_position_embeddings
        self.max_num_seqs = max_num_seqs
        self.buffers = StepBuffers(
            max(max_num_batched_tokens, max_num_seqs),
            max_num_seqs,
            ceil_div(max_len, block_size),
            self.device,
        )
        self.enforce_eager = enforce_eager
        self.decode_mode = "eager"  # eager | cuda-graphs
        self._graphs: CudaGraphDecoder | None = None
        capturable = self.attn.capabilities.graph_capturable
        if not enforce_eager and self.device.type == "cuda" and capturable:
            self._graphs = CudaGraphDecoder(self, graph_buckets(max_num_seqs))
            self.decode_mode = "cuda-graphs"

    def warmup(self) -> float:
        """Capture the decode graphs now (not at the first request); seconds taken.

        The captured warm-up steps write their K/V into the pool's scratch block only, so
        the pool's contents are untouched.
        """
        t0 = time.perf_counter()
        if self._graphs is not None:
            self._graphs.capture()
        return time.perf_counter() - t0

    def run(self, rows: Sequence[StepRow]) -> None:
        """One forward step over `rows`, filling in what each asks for (see StepRow). The
        rows of a draft chain stop getting tokens at its first disagreement; rows of a chain
        with a seeded generator are drawn one at a time, in order, so the generator advances
        exactly as one decode step per kept token would advance it."""
        batch = build_batch([r.span for r in rows], self.block_size, self.device, self.buffers)
        if self._slot_of is not None and self.kv_pool.window_slots is not None:
            batch.window_view = in_window_pool(batch, self._slot_of, self.kv_pool.window_slots)
        verifying = any(r.draft is not None for r in rows)
        if verifying and self.device.type == "cpu":
            # Every drafted row must get the logits its own decode step would have had.
            with kernels.exact_rows():
                logits = self._forward(batch)
        else:
            logits = self._forward(batch)
        owner = batch.logits_chunk_index  # the row each logits row belongs to
        if not owner:
            return
        # A row's token is drawn from its last logits row; those before it score its prompt.
        at = [
            k
            for k, i in enumerate(owner)
            if rows[i].span.need_logits and (k + 1 == len(owner) or owner[k + 1] != i)
        ]
        drawing = [rows[owner[k]] for k in at]
        how = [r.sampling or SamplingRow(temperature=0.0) for r in drawing]
        drawn = logits if len(at) == len(owner) else logits[at]
        if verifying:
            ids = _verify_chains(drawn, how, [owner[k] for k in at], [r.draft for r in rows])
        else:
            ids = sample_rows(drawn, how).tolist()  # the step's one device-to-host copy of ids
        for k, row, token in zip(at, drawing, ids, strict=True):
            row.token_id = token
            if token is not None and row.keep_logits:
                row.logits = logits[k].cpu()
        _score(logits, owner, rows, at)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        d = batch.decode
        graph_step = (
            d is not None
            and not batch.prefills
            and len(batch.logits_chunk_index) == d.num_seqs
            and batch.input_ids.data_ptr() == self.buffers.input_ids.data_ptr()
        )
        if graph_step and d is not None and self._graphs is not None and self._graphs.ready:
            return self._graphs.run(d.num_seqs)
        logits: torch.Tensor = self.model(batch, self.kv_pool, self.attn)
        return logits

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K/V (every layer) into block `dst` (in the window pool, from
        `src`'s slot to `dst`'s, where both have one)."""
        pool = self.kv_pool
        pool.k[:, dst] = pool.k[:, src]
        pool.v[:, dst] = pool.v[:, src]
        if self.window is not None:
            a, b = self.window.slot_of(src), self.window.slot_of(dst)
            if a >= 0 and b >= 0:
                pool.k_window[:, b] = pool.k_window[:, a]
                pool.v_window[:, b] = pool.v_window[:, a]

    def _pad_rows(self, start: int, stop: int) -> None:
        """Make buffer rows [start, stop) harmless decode rows: token 0 at position 0,
        writing its K/V into the scratch block and attending to that one token."""
        if stop <= start:
            return
        b = self.buffers
        scratch = self.kv_pool.scratch_block
        b.input_ids[start:stop] = 0
        b.positions[start:stop] = 0
        b.slot_mapping[start:stop] = scratch * self.block_size
        b.block_table[start:stop] = scratch
        b.context_lens[start:stop] = 1


def _score(
    logits: torch.Tensor, owner: Sequence[int], rows: Sequence[StepRow], drawn_at: Sequence[int]
) -> None:
    """Fill the rows' `logprobs` and `scores` with one log-softmax over every logits row
    that needs one (drawn tokens that ask for log-probs, then prompt rows); `owner[k]` is
    the row of logits row k, and `drawn_at` the logits rows tokens were drawn from."""
    at: list[int] = []
    targets: list[int] = []
    tops: list[int] = []
    into: list[tuple[StepRow, bool]] = []  # (row, whether the entry is its drawn token's)
    for k in drawn_at:
        row = rows[owner[k]]
        top = row.sampling.logprobs if row.sampling is not None else None
        if row.token_id is not None and top is not None:
            at.append(k)
            targets.append(row.token_id)
            tops.append(top)
            into.append((row, True))
    seen: set[int] = set()
    for k, i in enumerate(owner):
        score = rows[i].score
        if score is None or i in seen:
            continue
        seen.add(i)
        for j, target in enumerate(score.target_ids):
            at.append(k + j)
            targets.append(target)
            tops.append(score.num_top)
            into.append((rows[i], False))
    if not at:
        return
    for (row, drawn), lp in zip(into, token_logprobs(logits, at, targets, tops), strict=True):
        if drawn:
            row.logprobs = lp
        else:
            row.scores.append(lp)


def _verify_chains(
    drawn: torch.Tensor,
    how: Sequence[SamplingRow],
    row_of: Sequence[int],
    drafts: Sequence[int | None],
) -> list[int | None]:
    """The token of each drawn logits row (`drawn[j]`, of step row `row_of[j]`, drawn as
    `how[j]`), None for the rows of a draft chain after its first disagreement (see
    StepRow). Rows outside a seeded chain are drawn in one batch."""
    at = {i: j for j, i in enumerate(row_of)}
    chained = {i for i, d in enumerate(drafts) if d is not None}
    chained |= {i + 1 for i in chained}
    lazy = {j for j, i in enumerate(row_of) if i in chained and how[j].generator is not None}
    ids: list[int | None] = [None] * len(how)
    eager = [j for j in range(len(how)) if j not in lazy]
    if eager:
        sub = drawn if len(eager) == len(how) else drawn[eager]
        for j, t in zip(eager, sample_rows(sub, [how[j] for j in eager]).tolist(), strict=True):
            ids[j] = t
    for i in sorted(chained):
        j = at[i]
        prev = at.get(i - 1)
        follows = i > 0 and drafts[i - 1] is not None
        if follows and (prev is None or ids[prev] is None or ids[prev] != drafts[i - 1]):
            ids[j] = None  # an earlier row disagreed: this position is not reached
            continue
        if j in lazy:
            ids[j] = int(sample_rows(drawn[j : j + 1], [how[j]])[0])
    return ids


class CudaGraphDecoder:
    """Decode steps replayed from CUDA graphs, one per batch-size bucket, captured over the
    runner's buffers; a batch is padded up to its bucket with harmless rows."""

    def __init__(self, runner: ModelRunner, buckets: Sequence[int]) -> None:
        self.runner = runner
        self.buckets = list(buckets)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.ready = False

    def _step(self, size: int) -> torch.Tensor:
        r, b = self.runner, self.runner.buffers
        return r.model.decode(
            b.input_ids[:size],
            b.positions[:size],
            b.slot_mapping[:size],
            b.block_table[:size],
            b.context_lens[:size],
            r.kv_pool,
            r.attn,
        )

    def capture(self) -> None:
        """Capture every bucket's graph (largest first, sharing one memory pool)."""
        self.runner._pad_rows(0, max(self.buckets))
        pool = None
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in sorted(self.buckets, reverse=True):
                for _ in range(2):  # warm up: lazy init, autotuning, allocator
                    self._step(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._step(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.ready = True

    def run(self, num_seqs: int) -> torch.Tensor:
        """Logits [num_seqs, vocab] of the decode step in the buffers' first rows."""
        size = bucket_for(num_seqs, self.buckets)
        if size is None:
            raise ValueError(f"{num_seqs} sequences exceed the largest graph ({self.buckets[-1]})")
        self.runner._pad_rows(num_seqs, size)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
