"""Admission, chunked prefill, cache-aware ordering and preemption, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from radixserve.engine.kv_manager import KVCacheManager
from radixserve.engine.request import Request, RequestState
from radixserve.model.batch import SeqChunk
from radixserve.values import SCHEDULE_POLICIES, ceil_div

LPM_MAX_QUEUE = 128  # past this many waiting requests, ordering by match costs too much


@dataclass
class ScheduledChunk:
    """Compute `num_tokens` of `req` from its `num_computed`; `samples` when that reaches
    the end of its tokens, so the step yields its next token. `drafts` (speculative decoding,
    set by the engine after scheduling) are tokens verified after that one in the same step."""

    req: Request
    num_tokens: int
    drafts: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk ends at the request's last token."""
        return self.req.num_computed + self.num_tokens == len(self.req.token_ids)

    def seq_chunk(self, logits_from: int | None = None) -> SeqChunk:
        """What the model runner computes for this chunk (scoring rows from `logits_from`)."""
        r = self.req
        ids = r.token_ids[r.num_computed : r.num_computed + self.num_tokens]
        return SeqChunk(ids, r.num_computed, r.block_table, self.samples, logits_from)

    def draft_chunks(self) -> list[SeqChunk]:
        """One single-token chunk per drafted token, at the positions after this chunk."""
        r = self.req
        start = r.num_computed + self.num_tokens
        return [SeqChunk([d], start + j, r.block_table) for j, d in enumerate(self.drafts)]


@dataclass
class SchedulerOutput:
    """What one step runs, and who was pushed back to the queue to make room."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes.

    Running requests go first (their decode tokens, then the rest of their prefill), under
    a per-step token budget; waiting requests are admitted in cache-aware order (longest
    cached prefix first, with aging) while budget, sequence slots and blocks remain.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        policy: str = "lpm",
        aging_s: float = 5.0,
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; use one of {SCHEDULE_POLICIES}")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.aging_s = aging_s
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._admitted = 0

    def add(self, req: Request) -> None:
        """Queue a new request."""
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, cache_computed: bool = True) -> None:
        """End `req` here: out of the queues, its blocks and locks released (its computed
        blocks offered to the cache with `cache_computed`), its state FINISHED."""
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req, cache_computed)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED

    def has_work(self) -> bool:
        """Whether anything waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks, allocating blocks and preempting if the pool is short."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        # Decodes first (one token each), then continued prefills, oldest first.
        order = sorted(self.running, key=lambda r: (r.num_remaining > 1, r.admitted_seq))
        for req in order:
            if req.state is not RequestState.RUNNING or budget <= 0:
                continue
            n = min(req.num_remaining, budget)
            while not self.kv.ensure_blocks(req, req.num_computed + n):
                victim = self._pick_victim(scheduled, exclude=req) or req
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.state is RequestState.RUNNING:
                out.chunks.append(ScheduledChunk(req, n))
                scheduled.add(id(req))
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bs = self.kv.block_size
        reserve = len(self.running)  # one block of decode growth per running request
        if (
            not self.waiting
            or budget <= 0
            or len(self.running) >= self.max_num_seqs
            or self.kv.num_available() <= reserve  # no request needs fewer than one block
        ):
            return  # nothing can be admitted: skip ordering (and peeking) the queue
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._waits_for_leader(req):
                continue  # one prefill for every choice: the leader's
            peek = self.kv.peek(req)
            if self._shares_uncached_prefix(req, peek):
                continue  # let the other request compute it once, then hit the cache
            need = ceil_div(len(req.token_ids), bs) - peek // bs
            reserve = len(self.running)
            if need + reserve + peek // bs > self.kv.num_available():
                break
            self.kv.admit(req)
            n = min(req.num_remaining, budget)
            if not self.kv.ensure_blocks(req, req.num_computed + n):
                self.kv.release(req, cache_computed=False)
                break
            self.waiting.remove(req)
            self._admitted += 1
            req.admitted_seq = self._admitted
            req.state = RequestState.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n

    def _admission_order(self) -> list[Request]:
        if self.policy == "fcfs" or len(self.waiting) > LPM_MAX_QUEUE:
            return list(self.waiting)
        now = time.monotonic()

        def key(r: Request) -> tuple[int, int, float]:
            aged = now - r.metrics.arrival_time > self.aging_s
            return (0 if aged else 1, 0 if aged else -self.kv.peek(r), r.metrics.arrival_time)

        return sorted(self.waiting, key=key)

    def _shares_uncached_prefix(self, req: Request, cached: int) -> bool:
        """True if a running request is still prefilling the block after `req`'s cached
        prefix, so `req` would compute the same tokens again."""
        end = cached + self.kv.block_size
        if not self.kv.cache.enabled or end > len(req.token_ids) - 1:
            return False
        block = req.token_ids[cached:end]
        for other in self.running:
            if (
                other.namespace == req.namespace
                and other.num_computed < other.num_prompt_tokens
                and other.token_ids[cached:end] == block  # cheap test first
                and other.token_ids[:cached] == req.token_ids[:cached]
            ):
                return True
        return False

    def _waits_for_leader(self, req: Request) -> bool:
        """True for a choice i > 0 whose leader has not computed the shared prompt yet (it
        then starts from the leader's blocks instead of prefilling them again)."""
        lead = req.leader
        return (
            lead is not None
            and self.kv.cache.enabled
            and not lead.is_finished
            and lead.num_computed < lead.num_prompt_tokens
            and len(req.token_ids) == req.num_prompt_tokens
        )

    def _pick_victim(self, scheduled: set[int], exclude: Request) -> Request | None:
        candidates: Iterable[Request] = (
            r for r in self.running if r is not exclude and id(r) not in scheduled
        )
        return max(candidates, key=lambda r: r.admitted_seq, default=None)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free `req`'s private blocks (its computed whole blocks stay in the tree) and
        requeue it at the front; it recomputes what the cache no longer holds."""
        self.running.remove(req)
        self.kv.release(req, cache_computed=True)
        req.state = RequestState.WAITING
        self.num_preemptions += 1
        self.waiting.insert(0, req)
        out.preempted.append(req)
