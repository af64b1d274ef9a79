"""One node of the radix tree: a run of whole token blocks and their KV block ids."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from radixserve.cache.tokens import TOKEN_BYTES, decode


class RadixNode:
    """A node of `RadixCache`: a run of tokens (whole blocks) and the blocks holding their KV.

    Fields are owned by the cache and must be treated as read-only outside it; the
    eviction policies read `last_access`, `priority`, `lock_ref` and `children`, and own
    `score`, `protected` and `warm_until` (their per-node state, copied on a split).
    An `offloaded` node's blocks live in the cache's second tier; its descendants are
    offloaded too. `tokens` is the packed run (see `radixserve.cache.tokens`); `children` maps the
    packed first block of each child's run to the child. A root has an empty run,
    no blocks and no parent, and is never locked or evicted.
    """

    __slots__ = (
        "tokens",
        "blocks",
        "parent",
        "children",
        "namespace",
        "lock_ref",
        "last_access",
        "priority",
        "score",
        "protected",
        "warm_until",
        "in_heap",
        "removed",
        "hit_count",
        "access_time",
        "offloaded",
    )

    def __init__(
        self,
        tokens: bytes,
        blocks: list[int],
        parent: RadixNode | None,
        namespace: Hashable,
        last_access: int = 0,
        priority: int = 0,
    ) -> None:
        self.tokens = tokens
        self.blocks = blocks
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.namespace = namespace
        self.lock_ref = 0  # requests pinning this node (a lock pins the whole path to the root)
        self.last_access = last_access  # logical clock of the cache, bigger is more recent
        self.priority = priority  # higher is kept longer by priority-aware policies
        self.score = 0.0  # a policy's worth of the node (fanout: log of decayed hits)
        self.protected = False  # in a policy's protected segment (slru)
        self.warm_until = 0.0  # kept warm for a session until this clock time
        self.in_heap: Any = None  # its live entry in an eviction queue, if any
        self.removed = False  # pruned from the tree; the handle is dead
        self.hit_count = 0  # lookups whose matched prefix covered this node (for observers)
        self.access_time = 0.0  # time.monotonic() of the last lookup or insert through it
        self.offloaded = False  # `blocks` are ids of the offload tier, not of the pool

    @property
    def is_root(self) -> bool:
        """Whether this is the root of a namespace (holds no tokens)."""
        return self.parent is None and not self.removed

    @property
    def is_leaf(self) -> bool:
        """Whether the node has no children."""
        return not self.children

    @property
    def num_tokens(self) -> int:
        """Number of tokens in this node's own run (not the whole path)."""
        return len(self.tokens) // TOKEN_BYTES

    @property
    def token_ids(self) -> tuple[int, ...]:
        """This node's own run of token ids, unpacked (for debugging and tests)."""
        return decode(self.tokens)

    def path_tokens(self) -> bytes:
        """The packed tokens of the whole path from the root to the end of this node."""
        parts: list[bytes] = []
        node: RadixNode | None = self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return b"".join(reversed(parts))

    def __repr__(self) -> str:
        return (
            f"RadixNode(num_tokens={self.num_tokens}, blocks={len(self.blocks)}, "
            f"children={len(self.children)}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, priority={self.priority})"
        )
