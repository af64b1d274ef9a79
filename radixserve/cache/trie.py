"""Read-only walks over the radix tree, shared by the cache's operations."""

from __future__ import annotations

from radixserve.cache.node import RadixNode
from radixserve.cache.tokens import LazyQuery

Walk = tuple[list[RadixNode], int, RadixNode | None, int]
"""What a walk found: the fully matched nodes, the bytes they cover, and the node the
match ended inside of (or None) with how many of its blocks matched (at least one)."""


def walk(root: RadixNode, block_bytes: int, query: LazyQuery) -> Walk:
    """Follow `query` down from `root` as far as whole blocks match. Changes nothing.

    Costs one dict lookup per node plus a memcmp over the matched bytes, so it is
    O(query length), independent of how many nodes the tree holds.
    """
    bb = block_bytes
    limit = query.limit_bytes
    data = query.data
    path: list[RadixNode] = []
    node = root
    off = 0
    while off < limit:
        if off + bb > len(data):
            data = query.ensure(off + bb)
        child = node.children.get(data[off : off + bb])
        if child is None:
            break
        run = child.tokens
        end = off + len(run)
        if end == off + bb:  # a one-block run equals its key: matched
            path.append(child)
            node = child
            off = end
            continue
        if end > len(data):
            data = query.ensure(end)
        if data.startswith(run, off):  # False when data ends before the run does
            path.append(child)
            node = child
            off = end
            continue
        # The first block matched (it is the key), so at least one block does. Binary
        # search the rest, comparing only the not-yet-verified segment each time.
        lo, hi = 1, min(len(run), len(data) - off) // bb
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data.startswith(run[lo * bb : mid * bb], off + lo * bb):
                lo = mid
            else:
                hi = mid - 1
        return path, off, child, lo
    return path, off, None, 0


def path_blocks(path: list[RadixNode]) -> list[int]:
    """The block ids of `path`'s nodes, in order."""
    blocks: list[int] = []
    for node in path:
        blocks += node.blocks
    return blocks


def post_order(node: RadixNode) -> list[RadixNode]:
    """`node` and its descendants, children before parents."""
    order: list[RadixNode] = []
    stack = [node]
    while stack:
        current = stack.pop()
        order.append(current)
        stack.extend(current.children.values())
    order.reverse()
    return order
