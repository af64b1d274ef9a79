"""`GET /v1/cache/tree`: the radix tree as JSON, with small subtrees folded to fit a budget.

Input is a `TreeSnapshot` (a flat copy taken under the cache lock), so everything here runs
off the engine thread and never touches live nodes. The budget keeps the biggest subtrees
(by tokens) as real nodes: starting from the namespace roots, the node with the most tokens
below it is expanded next, until `max_nodes` output nodes are used; the children left over
under an expanded node are folded into one "aggregate" node that carries their totals.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from radixserve.cache import TreeSnapshot

DEFAULT_MAX_NODES = 2000
MAX_MAX_NODES = 200_000
TOP_PREFIXES = 10

Decoder = Callable[[list[list[int]]], list[str]]
"""Token id lists -> their texts (one call for the whole tree)."""


def namespace_label(namespace: Hashable, show_text: bool) -> str | None:
    """How a namespace is shown: its name, or a short digest when text is hidden."""
    if namespace is None:
        return None
    name = namespace if isinstance(namespace, str) else str(namespace)
    if show_text:
        return name
    return "ns-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def tree_json(
    snap: TreeSnapshot,
    max_nodes: int,
    decode: Decoder | None,
    now: float,
    token_ids: bool = False,
) -> dict[str, Any]:
    """The JSON body of `/v1/cache/tree` for `snap` (see docs/server.md for the fields).

    With `decode` None the body carries token counts only: no token ids, no text, and
    namespaces as digests, so a viewer cannot read other tenants' prompts. Otherwise each
    node has its text, and also the token ids it came from if `token_ids`.
    """
    shape = _shape(snap)
    selected, folded = _select(snap, shape.children, shape.sub_tokens, max(1, max_nodes))
    nodes, heads = _nodes(snap, shape, selected, folded, decode is not None, now)
    if decode is not None:
        _add_text(nodes, heads, decode, token_ids)
    top = _top_prefixes(snap, shape.depth, shape.parent, decode, now)
    return {
        "object": "cache.tree",
        "block_size": snap.block_size,
        "num_nodes": snap.num_nodes,
        "num_namespaces": len(snap.namespaces),
        "cached_tokens": sum(shape.sub_tokens[i] for i in snap.namespaces),
        "max_nodes": max_nodes,
        "text": decode is not None,
        "nodes": nodes,
        "top_prefixes": top,
    }


class _Shape(NamedTuple):
    """Per row of a snapshot: where it sits and what is below it."""

    parent: list[int]  # -1 for a namespace root
    children: dict[int, list[int]]  # only rows that have children: fewer allocations
    sub_tokens: list[int]  # tokens of the row and every row below it
    sub_nodes: list[int]  # the row and every row below it
    depth: list[int]  # tokens from the root to the end of the row


def _shape(snap: TreeSnapshot) -> _Shape:
    """Parents, children, subtree sums and depths of every row, in two passes."""
    rows = snap.rows
    n = len(rows)
    parent = [r[0] for r in rows]
    sub_tokens = [r[1] for r in rows]
    sub_nodes = [1] * n
    depth = [0] * n
    children: dict[int, list[int]] = {}
    for i in range(n):
        p = parent[i]
        if p >= 0:
            depth[i] = depth[p] + rows[i][1]
            kids = children.get(p)
            if kids is None:
                children[p] = [i]
            else:
                kids.append(i)
    for i in range(n - 1, -1, -1):  # children come after their parent: sum bottom-up
        p = parent[i]
        if p >= 0:
            sub_tokens[p] += sub_tokens[i]
            sub_nodes[p] += sub_nodes[i]
    return _Shape(parent, children, sub_tokens, sub_nodes, depth)


def _nodes(
    snap: TreeSnapshot,
    shape: _Shape,
    selected: list[int],
    folded: dict[int, list[int]],
    show_text: bool,
    now: float,
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The output nodes of the `selected` rows, each followed by the aggregate of its
    `folded` children if any; with `show_text`, also each node's head tokens (empty for an
    aggregate), to be decoded."""
    rows, parent = snap.rows, shape.parent
    nodes: list[dict[str, Any]] = []
    out_id: dict[int, int] = {}
    heads: list[list[int]] = []
    for i in selected:
        r = rows[i]
        out_id[i] = len(nodes)
        node: dict[str, Any] = {
            "id": len(nodes),
            "parent": out_id[parent[i]] if parent[i] >= 0 else None,
            "tokens": r[1],
            "subtree_tokens": shape.sub_tokens[i],
            "subtree_nodes": shape.sub_nodes[i] - (parent[i] < 0),
            "depth_tokens": shape.depth[i],
            "hits": r[2],
            "age_s": _age(r[3], now),
            "lock_ref": r[4],
            "aggregated": 0,
        }
        if parent[i] < 0:
            node["namespace"] = namespace_label(snap.namespaces[i], show_text)
        if show_text:
            heads.append(list(array("I", r[5])))
        nodes.append(node)
        rest = folded.get(i)
        if rest:
            nodes.append(_aggregate(len(nodes), out_id[i], rest, rows, shape, now))
            if show_text:
                heads.append([])
    return nodes, heads


def _add_text(
    nodes: list[dict[str, Any]], heads: list[list[int]], decode: Decoder, token_ids: bool
) -> None:
    """Give every real node below a root its text (and its head's ids if `token_ids`)."""
    for node, head, text in zip(nodes, heads, decode(heads), strict=True):
        if not node["aggregated"] and node["parent"] is not None:
            if token_ids:
                node["token_ids"] = head  # the start of its own run (at most 32 tokens)
            node["text"] = text


def _select(
    snap: TreeSnapshot, children: dict[int, list[int]], sub_tokens: list[int], budget: int
) -> tuple[list[int], dict[int, list[int]]]:
    """Rows to show (parents first) and, per shown row, the children folded into one node."""
    shown = list(snap.namespaces)
    pending: dict[int, int] = {}  # shown row -> children not shown yet
    heap: list[tuple[int, int]] = []
    for root in shown:
        if root in children:
            pending[root] = len(children[root])
            heap += [(-sub_tokens[c], c) for c in children[root]]
    heapq.heapify(heap)
    is_shown = set(shown)
    # An output node for every shown row plus one aggregate per row with children left over.
    used = len(shown) + len(pending)
    parent = [r[0] for r in snap.rows] if heap else []
    while heap:
        _, c = heap[0]
        p = parent[c]
        cost = 1 - (pending[p] == 1) + (c in children)
        if used + cost > budget:
            break
        heapq.heappop(heap)
        used += cost
        shown.append(c)
        is_shown.add(c)
        pending[p] -= 1
        if not pending[p]:
            del pending[p]
        if c in children:
            pending[c] = len(children[c])
            for g in children[c]:
                heapq.heappush(heap, (-sub_tokens[g], g))
    order = sorted(shown)  # row order is pre-order: every parent before its children
    folded = {p: [c for c in children[p] if c not in is_shown] for p in pending}
    return order, folded


def _aggregate(
    node_id: int,
    parent_id: int,
    rest: list[int],
    rows: list[Any],
    shape: _Shape,
    now: float,
) -> dict[str, Any]:
    """One node standing for the subtrees at `rest` (siblings under one shown parent)."""
    sub_tokens, sub_nodes = shape.sub_tokens, shape.sub_nodes
    # A lookup or insert touches every node on its path, so the most recent access and any
    # lock in a subtree show on the subtree's top node: the folded children suffice.
    return {
        "id": node_id,
        "parent": parent_id,
        "tokens": sum(sub_tokens[c] for c in rest),
        "subtree_tokens": sum(sub_tokens[c] for c in rest),
        "subtree_nodes": sum(sub_nodes[c] for c in rest),
        "depth_tokens": shape.depth[shape.parent[rest[0]]],  # their parent's
        "hits": sum(rows[c][2] for c in rest),
        "age_s": _age(max(rows[c][3] for c in rest), now),
        "lock_ref": max(rows[c][4] for c in rest),
        "aggregated": len(rest),
    }


def _top_prefixes(
    snap: TreeSnapshot, depth: list[int], parent: list[int], decode: Decoder | None, now: float
) -> list[dict[str, Any]]:
    """The prefixes that saved the most prefill: hits x tokens from the root."""
    rows = snap.rows
    best = heapq.nlargest(
        TOP_PREFIXES,
        (i for i in range(len(rows)) if parent[i] >= 0 and rows[i][2] > 0),
        key=lambda i: rows[i][2] * depth[i],
    )
    out: list[dict[str, Any]] = []
    firsts: list[int] = []
    for i in best:
        first = i
        while parent[parent[first]] >= 0:
            first = parent[first]
        root = parent[first]
        firsts.append(first)
        out.append(
            {
                "namespace": namespace_label(snap.namespaces[root], decode is not None),
                "tokens": depth[i],
                "hits": rows[i][2],
                "saved_tokens": rows[i][2] * depth[i],
                "age_s": _age(rows[i][3], now),
                "lock_ref": rows[i][4],
            }
        )
    if decode is not None and best:
        texts = decode([list(array("I", rows[j][5])) for j in firsts + best])
        for k, entry in enumerate(out):
            entry["text"] = texts[k]  # the start of the prefix
            entry["last_text"] = texts[len(out) + k]  # the start of its last run
    return out


def _age(access_time: float, now: float) -> float | None:
    return round(max(0.0, now - access_time), 3) if access_time else None
