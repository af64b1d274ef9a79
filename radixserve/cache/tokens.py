"""Token runs as packed bytes, so the trie compares and hashes them at C speed.

A run of token ids is stored as the bytes of an `array("I")` (4 bytes per token).
Comparing bytes is a memcmp and slicing is a memcpy, whereas comparing tuples of
Python ints costs a rich comparison per token. Converting a list of ints still
costs a few nanoseconds per token, so queries are converted lazily: only as far as
the walk down the tree gets. Callers that hold their tokens in an `array("I")`
skip the conversion entirely.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TypeAlias

TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1
_MAX_AHEAD = 1024 * TOKEN_BYTES  # convert at most this far beyond what a walk asked for

TokenIds: TypeAlias = "Sequence[int] | array[int]"
"""Token ids as accepted by the cache: any int sequence; an `array("I")` is fastest."""


def encode(token_ids: TokenIds, start: int = 0, stop: int | None = None) -> bytes:
    """Pack `token_ids[start:stop]` into bytes; raise ValueError if an id is out of range."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return bytes(memoryview(token_ids)[start:stop])
    if start or stop is not None:
        token_ids = token_ids[start:stop]  # the whole sequence converts without this copy
    # `fromlist` converts a list about 30% faster than `array("I", seq)`, which goes
    # through the generic sequence protocol item by item.
    packed = array("I")
    try:
        packed.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))
    except OverflowError:
        raise ValueError(f"token ids must be ints in [0, {MAX_TOKEN_ID}]") from None
    return packed.tobytes()


def decode(data: bytes) -> tuple[int, ...]:
    """Unpack bytes made by `encode` back into token ids."""
    return tuple(array("I", data))


class LazyQuery:
    """A query's packed bytes, converted from the front on demand.

    `data` holds the first `len(data) // 4` tokens of the query: at least what walks
    asked for, at most the whole query (one partial block beyond `limit` at worst;
    walks never match it, since node runs are whole blocks). `ensure` grows `data`
    geometrically, at most 1024 tokens beyond the request, until a quarter of the
    query is needed; then it converts the whole query. So a miss converts one block,
    a short match (a system prompt before a long unique document) little more, and a
    long match about what one conversion of the whole query costs.
    """

    __slots__ = ("token_ids", "limit_bytes", "data")

    def __init__(self, token_ids: TokenIds, limit: int) -> None:
        self.token_ids = token_ids
        self.limit_bytes = limit * TOKEN_BYTES
        self.data = b""

    def ensure(self, num_bytes: int) -> bytes:
        """Make `data` cover at least `num_bytes` bytes (or the whole limit); return it."""
        have = len(self.data)
        want = min(self.limit_bytes, max(num_bytes, min(2 * have, num_bytes + _MAX_AHEAD)))
        if want <= have:
            return self.data
        if 4 * want >= self.limit_bytes:
            # A long match is likely to go on (a cached chat history): one conversion of
            # the whole query beats several sliced appends.
            want = self.limit_bytes
        stop = None if want == self.limit_bytes else want // TOKEN_BYTES
        if 4 * have <= want:
            # Re-converting a short head is cheaper than slicing and concatenating.
            self.data = encode(self.token_ids, 0, stop)
        else:
            self.data += encode(self.token_ids, have // TOKEN_BYTES, stop)
        return self.data
