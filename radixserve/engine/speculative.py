"""Speculative decoding without a draft model: draft tokens from text already seen.

Three drafters, tried in this order (which ones run is `SpeculativeConfig.method`):
1. the radix tree's own continuation (`radix`): where a request's tokens so far lie on a
   cached path (a regenerated answer, an agent step re-issued), the tokens that followed;
2. prompt lookup (every method): the latest earlier occurrence of the request's last n
   tokens (n from prompt_lookup_max down to prompt_lookup_min) in its own prompt and output,
   and what followed it;
3. suffix lookup across requests (`suffix`, `radix`): the same over the recent outputs of
   finished requests of the same namespace (cache_salt), so one tenant's text never drafts
   for another's. Bounded in tokens, oldest dropped first, cleared with the cache.

The engine verifies a request's last token plus its drafts in one step (one decode row
each) and keeps the longest run the model agrees with; see LLMEngine and
ModelRunner.run's `drafts`. How many tokens a request drafts adapts to what it accepted:
twice as many after a fully accepted draft, the accepted count plus one after a partial one,
and after two drafts in a row with nothing accepted it pauses, longer each time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from radixserve.cache import PrefixCache
from radixserve.engine.closing import closing_starts
from radixserve.engine.kv_manager import KVCacheManager
from radixserve.engine.request import Request
from radixserve.engine.scheduler import ScheduledChunk
from radixserve.engine.spec_config import SpeculativeConfig
from radixserve.engine.stats import EngineCounters

MAX_PAUSE_STEPS = 32  # the longest a request waits before drafting again after misses
# In a step that verifies drafts the CPU kernels compute each of up to 16 rows bit for bit as
# that row alone (kernels.exact_rows: gemm.cpp gemm_codes_exact, kquants.cpp row_dot_exact);
# more rows take the many-row kernels, whose sums are ordered differently. Drafts never take a
# step past 16 rows, so a drafted row gets exactly the logits its own decode step would have.
MAX_STEP_ROWS = 16
SUFFIX_STORE_MAX_TOKENS = 65536  # the cross-request store's cap, whatever the pool's size


class PromptLookup:
    """An n-gram index over one growing token sequence: n-gram -> where it last ended with a
    token after it. Extended incrementally as the sequence grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[tuple[int, ...], int] = {}
        self._upto = 0  # n-grams ending before this position are indexed

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of `tokens`' last n
        tokens (longest n first); [] when none occurred."""
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            pos = self._index.get(tuple(tokens[end - n :]))
            if pos is not None:
                # The text repeats with period end - pos here; a draft that reaches the end
                # goes on repeating it (a loop of one phrase drafts k tokens, not one).
                period = end - pos
                return [tokens[pos + j % period] for j in range(k)]
        return []

    def _extend(self, tokens: Sequence[int]) -> None:
        index, lo, hi = self._index, self.min_n, self.max_n
        for e in range(max(self._upto, lo), len(tokens)):  # n-grams ending at e, a token after
            for n in range(lo, min(hi, e) + 1):
                index[tuple(tokens[e - n : e])] = e
        self._upto = max(self._upto, len(tokens))


class SuffixStore:
    """N-grams of finished requests' outputs, per namespace -> what followed them; at most
    `capacity` tokens, the oldest sequences dropped first."""

    def __init__(self, min_n: int, max_n: int, capacity: int) -> None:
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self._seqs: OrderedDict[int, tuple[Hashable, list[int]]] = OrderedDict()
        self._index: dict[tuple[Hashable, tuple[int, ...]], tuple[int, int]] = {}
        self._next_id = 0
        self.num_tokens = 0

    def add(self, namespace: Hashable, tokens: Sequence[int]) -> None:
        """Remember `tokens` (an output, led by the prompt's last few tokens)."""
        tokens = list(tokens[-self.capacity :])
        if len(tokens) <= self.min_n:
            return
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = (namespace, tokens)
        self.num_tokens += len(tokens)
        for key, e in self._keys(namespace, tokens):
            self._index[key] = (sid, e)
        while self.num_tokens > self.capacity:
            self._drop_oldest()

    def draft(self, namespace: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed `tokens`' last n tokens in a stored sequence of the
        same namespace (longest n first); [] when none did."""
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            hit = self._index.get((namespace, tuple(tokens[end - n :])))
            if hit is not None:
                sid, e = hit
                return self._seqs[sid][1][e : e + k]
        return []

    def clear(self) -> None:
        """Forget everything (the prefix cache was reset)."""
        self._seqs.clear()
        self._index.clear()
        self.num_tokens = 0

    def _keys(
        self, namespace: Hashable, tokens: list[int]
    ) -> list[tuple[tuple[Hashable, tuple[int, ...]], int]]:
        return [
            ((namespace, tuple(tokens[e - n : e])), e)
            for e in range(self.min_n, len(tokens))
            for n in range(self.min_n, min(self.max_n, e) + 1)
        ]

    def _drop_oldest(self) -> None:
        sid, (namespace, tokens) = self._seqs.popitem(last=False)
        self.num_tokens -= len(tokens)
        for key, _ in self._keys(namespace, tokens):
            if self._index.get(key, (None,))[0] == sid:
                del self._index[key]


@dataclass
class _DraftState:
    """One request's drafting state."""

    lookup: PromptLookup
    length: int  # how many tokens the next draft may have
    misses: int = 0  # drafts in a row with nothing accepted
    pause: int = 2  # steps the next pause lasts
    wait: int = 0  # steps left in the current pause


class Speculator:
    """Drafts tokens for decoding requests and learns from what they accepted."""

    def __init__(
        self,
        config: SpeculativeConfig,
        cache: PrefixCache,
        pool_tokens: int,
        counters: EngineCounters | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.counters = counters if counters is not None else EngineCounters()
        self.use_tree = config.method == "radix" and cache.enabled
        self.suffixes = (
            SuffixStore(
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                min(pool_tokens, SUFFIX_STORE_MAX_TOKENS),
            )
            if config.method in ("suffix", "radix")
            else None
        )
        self._states: dict[str, _DraftState] = {}

    def attach_drafts(
        self, chunks: Sequence[ScheduledChunk], kv: KVCacheManager, budget: int, max_len: int
    ) -> None:
        """Give each decoding chunk of a step the tokens its request drafts, as many as the
        step's token `budget` (and MAX_STEP_ROWS), max_tokens, the context (`max_len`) and the
        pool's free blocks allow (a draft never evicts the cache or preempts a request) and
        its grammar accepts; the rows verifying them are ModelRunner.run's `drafts`."""
        rows = sum(c.num_tokens for c in chunks)
        spare = min(budget, MAX_STEP_ROWS) - rows
        for c in chunks:
            req, p = c.req, c.req.params
            scored = req.prompt_logprobs is None or req.cacheable_prefix is None
            if spare <= 0 or c.num_tokens != 1 or not c.samples or not scored:
                continue
            out = len(req.token_ids) - req.num_prompt_tokens
            limit = min(spare, p.max_tokens - out - 1, max_len - len(req.token_ids) - 1)
            if req.matcher is not None and p.structured is not None and p.structured.closes_as_json:
                while limit > 0 and closing_starts(p.max_tokens, out + limit):
                    limit -= 1  # the last tokens are steered to close the JSON: never drafted
            if limit <= 0:
                continue
            drafts = self.propose(req, limit)[:limit]
            if drafts and req.matcher is not None:
                drafts = drafts[: req.matcher.count_valid(drafts)]
            c.drafts = kv.reserve_free(req, len(req.token_ids), drafts)
            spare -= len(c.drafts)

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(`limit`, the request's current draft length) tokens to verify after
        `req`'s last token; [] to decode it normally this step."""
        st = self._states.get(req.request_id)
        if st is None:
            c = self.config
            lookup = PromptLookup(c.prompt_lookup_min, c.prompt_lookup_max)
            st = self._states[req.request_id] = _DraftState(lookup, c.num_speculative_tokens)
        if st.wait > 0:
            st.wait -= 1
            return []
        k = min(st.length, limit)
        if k <= 0:
            return []
        tokens = req.token_ids
        draft = self.cache.continuation(tokens, req.namespace, k) if self.use_tree else []
        if not draft:
            draft = st.lookup.draft(tokens, k)
        if not draft and self.suffixes is not None:
            draft = self.suffixes.draft(req.namespace, tokens, k)
        return draft

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Count a verification of `num_drafted` tokens that kept `num_accepted` (vLLM's
        spec_decode counters of the engine; the engine counts `req`'s), and adapt `req`'s draft
        length."""
        c = self.counters
        c.spec_decode_num_drafts += 1
        c.spec_decode_num_draft_tokens += num_drafted
        c.spec_decode_num_accepted_tokens += num_accepted
        self.observe(req, num_drafted, num_accepted)

    def observe(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Adapt `req`'s draft length to a verification that accepted `num_accepted` of
        `num_drafted` drafted tokens."""
        st = self._states.get(req.request_id)
        if st is None or num_drafted == 0:
            return
        top = self.config.num_speculative_tokens
        if num_accepted == num_drafted:
            st.length = min(top, 2 * st.length)
        else:
            st.length = min(top, num_accepted + 1)
        if num_accepted:
            st.misses, st.pause = 0, 2
            return
        st.misses += 1
        if st.misses >= 2:
            st.wait, st.pause = st.pause, min(2 * st.pause, MAX_PAUSE_STEPS)

    def finish(self, req: Request) -> None:
        """`req` ended: forget its state, and keep its output for drafting others."""
        self._states.pop(req.request_id, None)
        if self.suffixes is None or req.error is not None:
            return
        start = max(0, req.num_prompt_tokens - self.config.prompt_lookup_max)
        if len(req.token_ids) > req.num_prompt_tokens:
            self.suffixes.add(req.namespace, req.token_ids[start:])

    def reset(self) -> None:
        """The prefix cache was reset: forget the stored outputs too."""
        if self.suffixes is not None:
            self.suffixes.clear()
