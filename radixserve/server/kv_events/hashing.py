"""The block hashes of radixserve's KV events: stable across processes, restarts and machines.

A block's hash names the whole token prefix that ends with it, so it is a function of its
parent's hash, its own token ids and, for the first block of a path only, the cache salt (as
vLLM does: the salt reaches later blocks through the chain). The function, version 1:

    data = b"radixserve-kv-block-v1\\0"
           + (b"\\x00" + 8 zero bytes      if there is no parent,
              b"\\x01" + parent as 8 bytes big-endian  otherwise)
           + (b"\\x00"                      if there is no salt or a parent,
              b"\\x01" + len(salt utf-8) as 4 bytes big-endian + salt utf-8  otherwise)
           + every token id as 4 bytes little-endian
    hash = the last 8 bytes of sha256(data), read big-endian (an unsigned 64-bit int)

An int of the low 64 bits is also what vLLM publishes by default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), and what consumers such as llm-d's indexer expect.
Nothing here depends on PYTHONHASHSEED, the process or the platform's byte order.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

VERSION_TAG = b"radixserve-kv-block-v1\0"
_NO_PARENT = b"\x00" + bytes(8)
_NO_SALT = b"\x00"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every mainstream ABI has a 4-byte int
        return b"".join(int(t).to_bytes(4, "little") for t in token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def block_hash(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """The hash of one block (see the module's docstring); `salt` counts only when `parent`
    is None."""
    h = hashlib.sha256(VERSION_TAG)
    h.update(_NO_PARENT if parent is None else b"\x01" + parent.to_bytes(8, "big"))
    if salt is None or parent is not None:
        h.update(_NO_SALT)
    else:
        raw = salt.encode()
        h.update(b"\x01" + len(raw).to_bytes(4, "big") + raw)
    h.update(_token_bytes(token_ids))
    return int.from_bytes(h.digest()[-8:], "big")


def path_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, stop: int | None = None
) -> list[int]:
    """The hash of every whole block of the path `token_ids` (the first `stop` blocks)."""
    n = len(token_ids) // block_size if stop is None else stop
    out: list[int] = []
    parent: int | None = None
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        out.append(parent)
    return out
