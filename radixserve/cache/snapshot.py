"""Point-in-time copies of the radix tree: for observers (the dashboard, `/v1/cache/tree`)
and for saving the cache (`export_records`).

The observers' copy is flat and cheap to take: one tuple per node in pre-order (every parent
before its children), so whoever reads it can sum subtrees in one reverse pass without
touching the live tree, whose nodes the engine thread keeps changing.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from radixserve.cache.node import RadixNode
from radixserve.cache.tokens import TOKEN_BYTES, decode
from radixserve.cache.types import NodeRecord


class NodeRow(NamedTuple):
    """One node of a `TreeSnapshot`; a root has parent -1 and no tokens."""

    parent: int  # index of the parent row, -1 for a namespace root
    num_tokens: int  # tokens of this node's own run
    hit_count: int  # lookups whose matched prefix covered this node
    access_time: float  # time.monotonic() of its last lookup or insert (0.0: never)
    lock_ref: int  # requests pinning it now
    head: bytes  # packed first tokens of its run (see `radixserve.cache.tokens`)


Row = tuple[int, int, int, float, int, bytes]
"""A `NodeRow`'s fields as a plain tuple: building NamedTuples would double the copy time."""


@dataclass(frozen=True)
class TreeSnapshot:
    """Every node of every namespace at one moment, parents before children."""

    taken_at: float  # time.monotonic() when the copy was made
    block_size: int
    rows: list[Row]  # in `NodeRow`'s field order
    namespaces: dict[int, Hashable]  # row index of each root -> its namespace

    @property
    def num_nodes(self) -> int:
        """Nodes holding tokens (roots not counted)."""
        return len(self.rows) - len(self.namespaces)

    def nodes(self) -> list[NodeRow]:
        """Every row with its field names (slower than reading `rows`)."""
        return [NodeRow._make(r) for r in self.rows]


def take_snapshot(
    roots: Mapping[Hashable, RadixNode], block_size: int, head_tokens: int = 32
) -> TreeSnapshot:
    """Copy the trees under `roots`; the caller holds the cache's lock. Changes nothing."""
    head_bytes = head_tokens * TOKEN_BYTES
    rows: list[Row] = []
    namespaces: dict[int, Hashable] = {}
    append = rows.append
    for namespace, root in roots.items():
        namespaces[len(rows)] = namespace
        stack: list[tuple[RadixNode, int]] = [(root, -1)]
        while stack:
            node, parent = stack.pop()
            index = len(rows)
            tokens = node.tokens
            append(
                (parent, len(tokens) // TOKEN_BYTES, node.hit_count, node.access_time,
                 node.lock_ref, tokens[:head_bytes])
            )  # fmt: skip
            if node.children:
                stack += [(child, index) for child in node.children.values()]
    return TreeSnapshot(time.monotonic(), block_size, rows, namespaces)


def export_records(roots: Iterable[RadixNode]) -> list[NodeRecord]:
    """Every node under `roots` as a `NodeRecord`, most recently used first, parents before
    children; the caller holds the cache's lock. Changes nothing."""
    found: list[tuple[int, int, RadixNode]] = []
    for root in roots:
        stack = [(root, 0)]
        while stack:
            node, depth = stack.pop()
            for child in node.children.values():
                found.append((depth, id(child), child))
                stack.append((child, depth + 1))
    # Access times never grow down a path, so (newest, shallowest) puts parents first.
    found.sort(key=lambda f: (-f[2].last_access, f[0]))
    index = {nid: i for i, (_, nid, _) in enumerate(found)}
    return [
        NodeRecord(
            index.get(id(node.parent), -1),
            node.namespace,
            decode(node.tokens),
            list(node.blocks),
            node.offloaded,
            node.last_access,
            node.priority,
        )  # fmt: skip
        for _, _, node in found
    ]
