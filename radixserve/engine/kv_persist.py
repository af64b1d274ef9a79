"""Warm restarts: save the radix tree and its K/V at shutdown, load them back at start.

One file, `radixserve-kv-cache.bin` under `--kv-persist-dir`:

    MAGIC | K/V bytes of every saved node, in header order | header JSON | u64 len | MAGIC

The header holds the fingerprint (weights' hash, dtype, block size, model config, K/V
layout), the nodes (parent index, namespace, token run, priority, access time) and the
SHA-256 of the K/V bytes. A save that does not match this engine, is truncated or fails
its checksum is skipped with a warning: the engine starts cold and never serves K/V that
another model or dtype computed. A loaded save is deleted, so a crash later (no new save)
restarts cold rather than from an old state.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.cache import PrefixCache
from radixserve.cache.types import NodeRecord
from radixserve.model.config import ModelConfig
from radixserve.model.kv_tier import KVStore, gather_blocks, scatter_blocks

log = logging.getLogger(__name__)

SAVE_FILE = "radixserve-kv-cache.bin"
MAGIC = b"RADIXSERVE-KV-1\n"
_TAIL = struct.Struct("<Q")
_CHUNK = 1 << 24


class SaveRejected(Exception):
    """The save on disk cannot be used by this engine (the message says why)."""


@dataclass
class PersistReport:
    """What a save or a load did: nodes and blocks, bytes and seconds."""

    nodes: int = 0
    blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0


def weights_hash(model: torch.nn.Module) -> str:
    """BLAKE2b of every parameter and buffer's name, dtype, shape and bytes, and of every
    quantized matrix's kind and codes (`model.quantized_weights()`, where the model has it:
    codes are not parameters, and two quantizations of one checkpoint share its parameters)."""
    h = hashlib.blake2b(digest_size=20)

    def add(name: str, t: torch.Tensor) -> None:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        flat = t.detach().reshape(-1).contiguous().cpu()
        h.update(flat.view(torch.uint8).numpy().tobytes())

    for name, t in sorted(model.state_dict().items()):
        add(name, t)
    quantized = getattr(model, "quantized_weights", None)
    for name, w in quantized() if callable(quantized) else []:
        h.update(f"{name}:{w.kind};".encode())
        for part, t in (("qs", w.qs), ("scale", w.scale), ("minv", w.minv)):
            if t is not None:
                add(f"{name}.{part}", t)
    return h.hexdigest()


def _namespace_ok(namespace: Hashable) -> bool:
    return namespace is None or type(namespace) in (str, int)


class KVPersistence:
    """Saves and loads one engine's cache under `directory` (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        model: torch.nn.Module,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.path = Path(directory) / SAVE_FILE
        self.dtype = dtype
        fp = {
            "weights": weights_hash(model),
            "dtype": str(dtype).removeprefix("torch."),
            "block_size": block_size,
            "model_config": asdict(config),
            "kv_layout": [config.num_layers, block_size, config.num_kv_heads, config.head_dim],
        }
        self.fingerprint: dict[str, Any] = json.loads(json.dumps(fp))
        elem = torch.tensor([], dtype=dtype).element_size()
        self.block_bytes = config.num_layers * block_size * config.num_kv_heads
        self.block_bytes *= config.head_dim * elem  # K or V of one block

    # ------------------------------------------------------------------ save

    def save(self, cache: PrefixCache, pool: KVStore, tier: KVStore | None) -> PersistReport:
        """Write every cached node (pool and tier) and its K/V; atomic (temp + rename)."""
        t0 = time.monotonic()
        records = cache.export_nodes()
        kept: list[NodeRecord] = []
        index: dict[int, int] = {}
        for i, rec in enumerate(records):
            if not _namespace_ok(rec.namespace) or (rec.parent >= 0 and rec.parent not in index):
                continue
            index[i] = len(kept)
            kept.append(rec._replace(parent=index.get(rec.parent, -1)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        try:
            nbytes = self._write(tmp, kept, pool, tier)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path)
        blocks = sum(len(r.blocks) for r in kept)
        return PersistReport(len(kept), blocks, nbytes, time.monotonic() - t0)

    def _write(self, tmp: Path, kept: list[NodeRecord], pool: KVStore, tier: KVStore | None) -> int:
        """Write the save file to `tmp`, fsynced; returns the K/V bytes written."""
        digest = hashlib.sha256()
        nbytes = 0
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            for rec in kept:
                store = tier if rec.offloaded else pool
                assert store is not None
                for part in gather_blocks(store, rec.blocks):
                    data = part.contiguous().cpu().view(torch.uint8).numpy().data
                    digest.update(data)
                    f.write(data)
                    nbytes += data.nbytes
            header = {
                "fingerprint": self.fingerprint,
                "data_bytes": nbytes,
                "sha256": digest.hexdigest(),
                "nodes": [
                    [r.parent, r.namespace, list(r.token_ids), r.priority, r.last_access]
                    for r in kept
                ],
            }
            raw = json.dumps(header, separators=(",", ":")).encode()
            f.write(raw)
            f.write(_TAIL.pack(len(raw)))
            f.write(MAGIC)
            f.flush()
            os.fsync(f.fileno())
        return nbytes

    # ------------------------------------------------------------------ load

    def load(self, cache: PrefixCache, pool: KVStore, tier: KVStore | None) -> PersistReport | None:
        """Load a save into an empty `cache`: the most recent nodes into the pool, then
        the tier, as far as they fit. Returns None (after a warning) if there is no
        usable save; on success deletes the save file. Raises (OSError, EOFError) if the
        file fails after it was verified: the cache may then hold nodes without K/V and
        must be discarded."""
        if not self.path.exists():
            return None
        t0 = time.monotonic()
        try:
            with open(self.path, "rb") as f:
                header = self._read_header(f)
                report = self._load_nodes(f, header, cache, pool, tier)
        except SaveRejected as e:
            log.warning("kv cache save %s not loaded, starting cold: %s", self.path, e)
            return None
        self.path.unlink()
        report.seconds = time.monotonic() - t0
        return report

    def _read_header(self, f: io.BufferedReader) -> dict[str, Any]:
        """Check magic, size, fingerprint and checksum; return the header."""
        size = os.fstat(f.fileno()).st_size
        tail = len(MAGIC) + _TAIL.size
        if size < 2 * len(MAGIC) + _TAIL.size or f.read(len(MAGIC)) != MAGIC:
            raise SaveRejected("not a radixserve KV save (or truncated)")
        f.seek(size - tail)
        (raw_len,) = _TAIL.unpack(f.read(_TAIL.size))
        if f.read(len(MAGIC)) != MAGIC or raw_len > size - tail - len(MAGIC):
            raise SaveRejected("truncated (its end marker is missing)")
        data_end = size - tail - raw_len
        f.seek(data_end)
        try:
            header: dict[str, Any] = json.loads(f.read(raw_len))
        except ValueError as e:
            raise SaveRejected(f"corrupt header: {e}") from None
        if header.get("fingerprint") != self.fingerprint:
            raise SaveRejected(self._mismatch(header.get("fingerprint")))
        if header.get("data_bytes") != data_end - len(MAGIC):
            raise SaveRejected("truncated (K/V bytes are missing)")
        digest = hashlib.sha256()
        f.seek(len(MAGIC))
        left = data_end - len(MAGIC)
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise SaveRejected("truncated while reading")
            digest.update(chunk)
            left -= len(chunk)
        if digest.hexdigest() != header.get("sha256"):
            raise SaveRejected("checksum mismatch (the K/V bytes are corrupt)")
        f.seek(len(MAGIC))
        return header

    def _mismatch(self, other: object) -> str:
        if not isinstance(other, dict):
            return "it has no fingerprint"
        keys = [k for k in self.fingerprint if other.get(k) != self.fingerprint[k]]
        return "it was saved by a different " + ", ".join(keys or ["format"])

    def _load_nodes(
        self,
        f: io.BufferedReader,
        header: dict[str, Any],
        cache: PrefixCache,
        pool: KVStore,
        tier: KVStore | None,
    ) -> PersistReport:
        bs = cache.block_size
        records = [
            NodeRecord(parent, namespace, tuple(tokens), [], False, last_access, priority)
            for parent, namespace, tokens, priority, last_access in header["nodes"]
        ]
        report = PersistReport()
        for rec, node in zip(records, cache.restore_nodes(records), strict=True):
            n = len(rec.token_ids) // bs
            if node is None:
                f.seek(2 * n * self.block_bytes, os.SEEK_CUR)
                continue
            k = self._read_blocks(f, n)
            v = self._read_blocks(f, n)
            store = tier if node.offloaded else pool
            assert store is not None
            scatter_blocks(store, node.blocks, k, v)
            report.nodes += 1
            report.blocks += n
            report.nbytes += 2 * n * self.block_bytes
        return report

    def _read_blocks(self, f: io.BufferedReader, n: int) -> torch.Tensor:
        raw = bytearray(n * self.block_bytes)
        if f.readinto(raw) != len(raw):  # the file changed after its checksum passed
            raise EOFError(f"{self.path} ended early while loading")
        layers, bs, heads, dim = self.fingerprint["kv_layout"]
        t = torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype)
        return t.view(layers, n, bs, heads, dim)
