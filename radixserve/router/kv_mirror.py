"""A worker's cache mirror fed by vLLM-format KV events (BlockStored / BlockRemoved /
AllBlocksCleared), for vLLM workers and radixserve workers run with --kv-events-config.

Events name blocks by hash. `BlockMirror` keeps, per hash, the block's parent, its token ids,
the cache salt in its `extra_keys` (a path's namespace is its first block's salt, as vLLM and
radixserve put it there) and the media it is cached in; a block is cached while any medium
holds it. The `WorkerTrie` holds exactly the token paths whose every block is cached, which is
what a request can hit: a block whose parent was dropped is unreachable there (vLLM keeps
such blocks, and they count again once the parent is stored again). Repeated BlockStored
events (vLLM re-announces reused blocks) change nothing.
"""

from __future__ import annotations

from collections.abc import Hashable

from radixserve.router.trie import WorkerTrie
from radixserve.server.kv_events.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    salt_of,
)


class BlockSizeMismatch(ValueError):
    """The worker's events are in blocks of another size than the mirror's."""


class _Block:
    __slots__ = ("parent", "tokens", "namespace", "media", "children")

    def __init__(self, parent: BlockHash | None, tokens: tuple[int, ...], namespace: Hashable):
        self.parent = parent
        self.tokens = tokens
        self.namespace = namespace
        self.media: set[str | None] = set()
        self.children: set[BlockHash] = set()


class BlockMirror:
    """Applies KV events to `trie` (whose block size the events must use)."""

    def __init__(self, trie: WorkerTrie) -> None:
        self.trie = trie
        self.blocks: dict[BlockHash, _Block] = {}
        # Blocks stored before their parent was (a subscriber that joined late): parent -> them.
        self._orphans: dict[BlockHash, set[BlockHash]] = {}

    @property
    def num_cached(self) -> int:
        """Blocks cached in some medium (reachable or not)."""
        return sum(1 for b in self.blocks.values() if b.media)

    def apply(self, event: KVEvent) -> None:
        """Apply one event; raises BlockSizeMismatch for a BlockStored of another size."""
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def clear(self) -> None:
        """Forget everything."""
        self.blocks.clear()
        self._orphans.clear()
        self.trie.clear()

    def _stored(self, ev: BlockStored) -> None:
        bs = self.trie.block_size
        if ev.block_size != bs:
            raise BlockSizeMismatch(
                f"the worker's events are in blocks of {ev.block_size} tokens, the router's "
                f"mirror in blocks of {bs}: start the router with --block-size {ev.block_size}"
            )
        parent = ev.parent_block_hash
        fresh: list[BlockHash] = []  # blocks that were not cached in any medium
        for i, h in enumerate(ev.block_hashes):
            tokens = tuple(ev.token_ids[i * bs : (i + 1) * bs])
            if len(tokens) < bs:
                break
            block = self.blocks.get(h)
            if block is None:
                keys = ev.extra_keys[i] if ev.extra_keys and i < len(ev.extra_keys) else None
                above = self.blocks.get(parent) if parent is not None else None
                block = self.blocks[h] = _Block(parent, tokens, salt_of(keys, ev.lora_name))
                block.children = self._orphans.pop(h, set())
                if above is not None:
                    above.children.add(h)
                elif parent is not None:
                    self._orphans.setdefault(parent, set()).add(h)
            if not block.media:
                fresh.append(h)
            block.media.add(ev.medium)
            parent = h
        if fresh:
            self._attach(fresh)

    def _attach(self, fresh: list[BlockHash]) -> None:
        """Put the paths through newly cached blocks into the trie: the deepest of the run,
        and every cached path below a fresh block that was waiting for it."""
        done: set[BlockHash] = set()
        for h in reversed(fresh):
            if h in done:
                continue
            path = self._path(h)
            if path is None:
                continue
            for leaf, (namespace, tokens) in self._cached_leaves(h, path):
                self.trie.insert(tokens, namespace)
                done.add(leaf)
            node: BlockHash | None = h
            while node is not None and node not in done:
                done.add(node)
                node = self.blocks[node].parent

    def _cached_leaves(
        self, h: BlockHash, path: tuple[Hashable, tuple[int, ...]]
    ) -> list[tuple[BlockHash, tuple[Hashable, tuple[int, ...]]]]:
        """(block, path) of each deepest cached descendant of `h` reachable through cached
        blocks (`h` itself if none); `path` is h's."""
        out = []
        stack = [(h, path[1])]
        while stack:
            node, tokens = stack.pop()
            below = [c for c in self.blocks[node].children if self.blocks[c].media]
            if not below:
                out.append((node, (path[0], tokens)))
            stack += [(c, tokens + self.blocks[c].tokens) for c in below]
        return out

    def _path(self, h: BlockHash) -> tuple[Hashable, tuple[int, ...]] | None:
        """(namespace, token ids from the root through `h`), or None if some block on the way
        is not cached (or not known)."""
        parts: list[tuple[int, ...]] = []
        node: BlockHash | None = h
        namespace: Hashable = None
        while node is not None:
            block = self.blocks.get(node)
            if block is None or not block.media:
                return None
            parts.append(block.tokens)
            namespace = block.namespace
            node = block.parent
        return namespace, tuple(t for part in reversed(parts) for t in part)

    def _removed(self, ev: BlockRemoved) -> None:
        for h in ev.block_hashes:
            block = self.blocks.get(h)
            if block is None or ev.medium not in block.media:
                continue
            path = self._path(h)  # before the block goes: is it in the trie?
            block.media.discard(ev.medium)
            if block.media:
                continue
            if path is not None:
                self.trie.remove(path[1], path[0], len(block.tokens))
            self._forget(h)

    def _forget(self, h: BlockHash) -> None:
        """Drop uncached blocks that no cached block hangs below, from `h` upwards."""
        node: BlockHash | None = h
        while node is not None:
            block = self.blocks[node]
            if block.media or block.children:
                return
            del self.blocks[node]
            parent = block.parent
            if parent is not None and parent in self.blocks:
                self.blocks[parent].children.discard(node)
                node = parent
            else:
                waiting = self._orphans.get(parent) if parent is not None else None
                if waiting is not None:
                    waiting.discard(node)
                    if not waiting:
                        del self._orphans[parent]  # type: ignore[arg-type]
                return
