"""Read-only walks over the radix tree, shared by the cache's operations."""

from __future__ import annotations

from radixserve.cache.node import RadixNode
from radixserve.cache.tokens import TOKEN_BYTES, LazyQuery, TokenIds, decode, encode

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


def continuation(
    root: RadixNode, block_bytes: int, token_ids: TokenIds, max_tokens: int
) -> list[int]:
    """Up to `max_tokens` token ids that follow `token_ids` along a cached path, or [] when
    `token_ids` does not lie on one (every whole block cached, then its partial last block
    the start of a cached run). Where the path branches, the most recently used child is
    followed. Changes nothing."""
    if max_tokens <= 0:
        return []
    whole = len(token_ids) // (block_bytes // TOKEN_BYTES) * (block_bytes // TOKEN_BYTES)
    path, off, child, k = walk(root, block_bytes, LazyQuery(token_ids, whole))
    if off + k * block_bytes < whole * TOKEN_BYTES:
        return []  # the sequence leaves the tree before its last whole block
    tail = encode(token_ids, whole)
    if child is not None:  # the match ends inside child's run, after k blocks
        node, at = child, k * block_bytes
    else:
        parent = path[-1] if path else root
        fits = [c for c in parent.children.values() if c.tokens.startswith(tail)]
        if not fits:
            return []
        node, at = max(fits, key=lambda c: c.last_access), 0
    if not node.tokens.startswith(tail, at):
        return []
    out = bytearray(node.tokens[at + len(tail) : at + len(tail) + max_tokens * TOKEN_BYTES])
    while len(out) < max_tokens * TOKEN_BYTES and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out += node.tokens[: max_tokens * TOKEN_BYTES - len(out)]
    return list(decode(bytes(out)))


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
