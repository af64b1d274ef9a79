"""Who owns which KV block: the radix tree, a running request, or the free list."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.cache import CacheEvent, CacheFullError, PrefixCache, RadixNode, SessionRetention
from radixserve.cache.window import NO_SLOT
from radixserve.engine.request import Request
from radixserve.values import ceil_div


def _path_blocks(node: RadixNode) -> list[int]:
    parts: list[list[int]] = []
    n: RadixNode | None = node
    while n is not None:
        parts.append(n.blocks)
        n = n.parent
    return [b for part in reversed(parts) for b in part]


class KVCacheManager:
    """Gives requests their block tables from `cache`'s pool, reusing cached prefixes.

    With the cache off (a `NullCache`) every block is private to its request and freed when
    it ends, with everything else identical: that is the baseline the cache is measured
    against. `copy_block(src, dst)` copies one block's K/V (all layers): how a prompt cached
    through its last token gets a private copy of its last block (see `admit`); without it
    the last token is never matched.

    With sliding-window layers in their own pool (`pool.window`), a request pins the window
    slots of the blocks its next step may read (`block_table[req.window_pinned_from:]`) and
    lets go of each block its window has passed, which another block's slot may then take.
    """

    def __init__(self, cache: PrefixCache, copy_block: Callable[[int, int], None] | None) -> None:
        self.cache = cache
        self.pool = cache.pool
        self.window = cache.pool.window
        self.block_size = cache.block_size
        self.copy_block = copy_block
        self.num_private_blocks = 0
        # vLLM's prefix_cache_queries / _hits: admitted prompts' tokens, and those a hit gave
        # them (a hit shortened to the window's slots or to the last token counts as given;
        # the cache's own hit_tokens counts what each lookup matched)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def policy_info(self) -> dict[str, object]:
        """The eviction settings, for /v1/cache/stats."""
        policy = self.cache.policy
        return {
            "eviction_policy": policy.name,
            "session_ttl": policy.ttl_s if isinstance(policy, SessionRetention) else 0.0,
            "namespace_quota_blocks": self.cache.namespace_quota_blocks,
        }

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_total

    def num_available(self) -> int:
        """Blocks obtainable now: free ones plus evictable cached ones."""
        return self.pool.num_free + self.cache.stats().evictable_blocks

    def peek(self, req: Request) -> int:
        """Cached-prefix length `admit` would find for `req` now (no side effects)."""
        limit = req.cacheable_prefix
        if limit is not None and limit < self.block_size:
            return 0
        cached = self.cache.peek_prefix(self._match_key(req), req.namespace)
        return cached if limit is None else min(cached, limit // self.block_size * self.block_size)

    def admit(self, req: Request) -> int:
        """Match `req`'s longest cached prefix, pin it, and start its block table with it.

        At most len(token_ids) - 1 tokens are taken as computed, so the last one is always
        computed and yields the next token's logits. When the whole prompt is cached (it ends
        on a block boundary), its last block is copied into a private block, so recomputing
        that one token writes only the copy: a repeat costs one decode step, not a block of
        prefill. Returns the number of cached tokens.
        """
        assert not req.block_table and req.lock_node is None
        n = len(req.token_ids)
        self.prefix_cache_queries += n
        key = req.token_ids if self.copy_block is not None else self._match_key(req)
        limit = req.cacheable_prefix
        if limit is not None:  # rows still to score must be computed: match only before them
            key = key[: limit // self.block_size * self.block_size]
        m = self.cache.match_prefix(key, req.namespace)
        if m.num_tokens:
            self.cache.lock(m.node)
            req.lock_node = m.node
        blocks = list(m.blocks)
        # Pin the hit's window before anything is allocated (which may take unpinned slots).
        cached, pinned_from = self._pin_hit(blocks, m.num_tokens)
        if cached == n:  # matched through the last token: all of it is in the tree
            blocks.pop()
            cached -= self.block_size
            assert self.copy_block is not None
            try:
                (copy,) = self.cache.allocate(1)  # the match is locked: not evicted for this
            except CacheFullError:
                copy = None
            if copy is not None:
                self.copy_block(m.blocks[-1], copy)
                if self.window is not None:
                    self.window.unpin(m.blocks[-1:])  # the copy (pinned) stands in for it
                req.block_table = blocks + [copy]
                req.num_shared_blocks = len(blocks)
                self.num_private_blocks += 1
                req.num_computed = n - 1
                req.window_pinned_from = pinned_from
                self.prefix_cache_hits += n - 1
                return n - 1
            if self.window is not None:  # a block shorter: its window may reach further back
                self.window.unpin(m.blocks[pinned_from:])
                cached, pinned_from = self._pin_hit(blocks, cached)
        del blocks[cached // self.block_size :]
        req.block_table = blocks
        req.num_shared_blocks = len(blocks)
        req.num_computed = cached
        req.window_pinned_from = pinned_from
        if self._fork_tail(req):
            cached = req.num_computed
        self.prefix_cache_hits += cached
        return cached

    def _pin_hit(self, blocks: list[int], cached: int) -> tuple[int, int]:
        """With a window pool: the part of a hit of `cached` tokens over `blocks` whose window
        still has its slots (the tree matched so far already), and the first block pinned for
        reading it (queries from its last token on); (cached, 0) without one."""
        if self.window is None:
            return cached, 0
        cached = self.window.usable(blocks, cached)
        lo = self.window.first_needed(max(0, cached - 1))
        self.window.pin(blocks[lo : cached // self.block_size])
        return cached, lo

    def _unpin_passed(self, req: Request) -> None:
        """Let go of the window slots of the blocks `req`'s window has passed."""
        if self.window is None:
            return
        lo = self.window.first_needed(req.num_computed)
        if lo > req.window_pinned_from:
            self.window.unpin(req.block_table[req.window_pinned_from : lo])
            req.window_pinned_from = lo

    def _fork_tail(self, req: Request) -> bool:
        """Copy-on-write of a shared prompt's last partial block: a choice i > 0 whose leader
        has computed the prompt and still holds that block (private, past the tree's whole
        blocks that `req` matched) starts from a copy of it, computed up to its last token.
        Returns whether it did."""
        lead, n, done = req.leader, len(req.token_ids), req.num_computed
        if (
            lead is None
            or self.copy_block is None
            or n != req.num_prompt_tokens  # a fresh choice, not one being resumed
            or not 0 < n - 1 - done < self.block_size
            or lead.num_computed < n - 1
            or lead.block_table[: len(req.block_table)] != req.block_table
            or len(lead.block_table) <= done // self.block_size
            or lead.token_ids[done : n - 1] != req.token_ids[done : n - 1]
        ):
            return False
        try:
            (copy,) = self.cache.allocate(1)  # the match is locked: not evicted for this
        except CacheFullError:
            return False
        self.copy_block(lead.block_table[done // self.block_size], copy)
        req.block_table.append(copy)
        self.num_private_blocks += 1
        req.num_computed = n - 1
        return True

    def ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        """Grow `req`'s block table to cover `num_tokens` tokens, evicting cached blocks if
        needed. Returns False, changing nothing, when the pool cannot supply them."""
        need = ceil_div(num_tokens, self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        try:
            new = self.cache.allocate(need)
        except CacheFullError:
            return False
        req.block_table.extend(new)
        self.num_private_blocks += need
        return True

    def reserve_free(self, req: Request, num_tokens: int, drafts: list[int]) -> list[int]:
        """The longest head of `drafts` whose K/V fits after `req`'s first `num_tokens`
        tokens, growing its block table from free blocks only (speculation never evicts a
        cached block or takes one a request needs)."""
        have = len(req.block_table) * self.block_size - num_tokens
        short = len(drafts) - have
        if short > 0:
            need = ceil_div(short, self.block_size)
            if self.pool.num_free >= need and self.ensure_blocks(req, num_tokens + len(drafts)):
                return drafts
        return drafts[: max(0, have)]

    def commit(self, req: Request, num_tokens: int) -> None:
        """Record that a step computed `num_tokens` more of `req`'s tokens; once the prompt
        is complete its blocks are published, so later requests hit it while it decodes."""
        start = req.num_computed
        req.num_computed += num_tokens
        self._unpin_passed(req)
        prompt_len = req.num_prompt_tokens
        if start < prompt_len <= req.num_computed:
            self.publish(req)

    def publish(self, req: Request) -> None:
        """Offer `req`'s computed whole blocks to the cache; those it keeps stay pinned by
        `req` and are no longer private (with the cache off it keeps none).

        Blocks another request published first are swapped for the tree's copies and the
        duplicates freed, so the tree keeps one block per cached token block.
        """
        n_full = req.num_computed // self.block_size
        if n_full <= req.num_shared_blocks:
            return
        tokens = req.token_ids[: n_full * self.block_size]
        res = self.cache.insert(
            tokens,
            req.block_table[:n_full],
            req.namespace,
            req.priority,
            session=req.session_id is not None,
        )
        self.cache.lock(res.node)
        if req.lock_node is not None:
            self.cache.unlock(req.lock_node)
        req.lock_node = res.node
        held = _path_blocks(res.node)  # the cache's blocks for `tokens`: all, or none if off
        shared = req.num_shared_blocks
        if self.window is not None:
            self._swap_window_slots(req, held)
        self.pool.free(res.duplicate_blocks)
        req.block_table[shared : len(held)] = held[shared:]
        self.num_private_blocks -= len(held) - shared
        req.num_shared_blocks = len(held)

    def _swap_window_slots(self, req: Request, held: list[int]) -> None:
        """Before `req`'s duplicates of blocks the tree already held are freed: the tree's
        block takes over `req`'s pins, and the duplicate's slot where it has none."""
        window = self.window
        assert window is not None
        for j in range(req.num_shared_blocks, len(held)):
            mine, tree = req.block_table[j], held[j]
            if mine == tree:
                continue
            if window.slot_of(tree) == NO_SLOT:
                if window.slot_of(mine) != NO_SLOT:
                    window.move(mine, tree)
            elif j >= req.window_pinned_from:
                window.pin([tree])
                window.unpin([mine])

    def release(self, req: Request, cache_computed: bool = True) -> None:
        """Give back everything `req` holds (blocks, lock); its computed whole blocks stay
        cached if asked. `req` is left with nothing computed."""
        if cache_computed:
            self.publish(req)
        if self.window is not None:
            self.window.unpin(req.block_table[req.window_pinned_from :])
            req.window_pinned_from = 0
        if req.lock_node is not None:
            self.cache.unlock(req.lock_node)
        private = req.block_table[req.num_shared_blocks :]
        if private:
            self.pool.free(private)
            self.num_private_blocks -= len(private)
        req.lock_node = None
        req.block_table = []
        req.num_shared_blocks = 0
        req.num_computed = 0

    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Forward the cache's insert/evict events to `fn` (none come with the cache off)."""
        self.cache.add_listener(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Stop forwarding events to `fn`."""
        self.cache.remove_listener(fn)

    def check_invariants(self) -> None:
        """Raise InvariantError if the cache's invariants or the block accounting are broken."""
        self.cache.check_invariants(self.num_private_blocks)
        if self.window is not None:
            self.window.check_invariants(
                b for b in range(self.pool.num_total) if not self.pool.is_free(b)
            )

    def _match_key(self, req: Request) -> list[int]:
        return req.token_ids[: len(req.token_ids) - 1]
