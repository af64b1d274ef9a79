"""`--attention-backend triton`: paged attention by our Triton kernels (triton_kernels.py) on
CUDA, reading K/V from the pool in place. Importing this module does not import triton:
building the backend does (and `triton_unavailable`, which says whether that can work)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from radixserve.model.attention.base import AttentionPlan, BackendCapabilities
from radixserve.model.batch import ForwardBatch

_TILE_FIELDS = 4  # prefill tile row: first query row, rows, first query position, block offset


def _kernels() -> ModuleType:
    """The kernels module (imports triton; ImportError without it)."""
    from radixserve.model.attention import triton_kernels

    return triton_kernels


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process (None when they can);
    imports triton, so call it only when that backend is asked for or CUDA is in use."""
    try:
        interpreted = _kernels().INTERPRETED
    except ImportError as e:
        return f"it needs the triton package ({e}); pip install 'radixserve[gpu]'"
    if device.type == "cuda":
        if interpreted:
            return "TRITON_INTERPRET=1 is set: the kernels would run in Triton's interpreter"
        return None
    if device.type == "cpu":
        if interpreted:
            return None
        return (
            "the Triton kernels run on CUDA devices (on the CPU only under Triton's "
            "interpreter, TRITON_INTERPRET=1, which is for tests); use --attention-backend "
            "sdpa or cpu here"
        )
    return f"the Triton kernels run on CUDA devices, not {device.type}"


@dataclass
class TritonPlan(AttentionPlan):
    """The step's prefill tile table and its chunks' block ids, concatenated (both None in a
    decode-only step, whose plan does nothing and so can be captured in a graph)."""

    prefill_tiles: torch.Tensor | None = None  # int32 [num_tiles, 4]
    prefill_blocks: torch.Tensor | None = None  # int32 [sum of the chunks' blocks]


class TritonPagedBackend:
    """Paged decode (flash-decoding) and varlen prefill over a cached prefix, by our Triton
    kernels. `partition_size` tokens of context per decode program; the tile sizes are the
    kernels' blocking (the defaults suit a GPU; tests shrink them). Imports triton."""

    name = "triton"
    capabilities = BackendCapabilities(
        devices=("cuda",),  # and the CPU under Triton's interpreter, when asked for by name
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        kv_dtypes=(),  # the kernels read K/V in the model dtype only
        reads_pool_in_place=True,
        fused_decode_step=False,
        narrows_last_layer=False,  # its plan builds a tile table per batch
        graph_capturable=True,
    )

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """'cannot run here: <why>' where `triton_unavailable` says why (imports triton)."""
        why = triton_unavailable(device)
        return None if why is None else f"cannot run here: {why}"

    def __init__(
        self,
        partition_size: int = 256,
        decode_tile: int = 32,
        prefill_block_m: int = 64,
        prefill_block_n: int = 64,
    ) -> None:
        if partition_size % decode_tile:
            raise ValueError("partition_size must be a multiple of decode_tile")
        self.partition_size = partition_size
        self.decode_tile = decode_tile
        self.block_m = prefill_block_m
        self.block_n = prefill_block_n
        self._kernels = _kernels()

    def plan(self, batch: ForwardBatch) -> TritonPlan:
        """The prefill tile table (host-built, one small copy); nothing for decode."""
        if not batch.prefills:
            return TritonPlan()
        device = batch.input_ids.device
        rows: list[int] = []
        offset = 0
        for p in batch.prefills:
            first_pos = p.context_len - p.num_tokens
            for i in range(0, p.num_tokens, self.block_m):
                n = min(self.block_m, p.num_tokens - i)
                rows += (p.token_start + i, n, first_pos + i, offset)
            offset += p.block_ids.shape[0]
        tiles = torch.tensor(rows, dtype=torch.int32).view(-1, _TILE_FIELDS).to(device)
        blocks = torch.cat([p.block_ids for p in batch.prefills]).to(torch.int32)
        return TritonPlan(prefill_tiles=tiles, prefill_blocks=blocks)

    def forward(
        self,
        q: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] (a view is fine) -> [T, H * D] in q's dtype."""
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if batch.decode is not None:
            d = batch.decode
            self.decode_into(
                q, k_blocks, v_blocks, d.block_table, d.context_lens, out, scale, window
            )
        if batch.prefills:
            if not isinstance(plan, TritonPlan) or plan.prefill_tiles is None:
                plan = self.plan(batch)
            assert plan.prefill_tiles is not None and plan.prefill_blocks is not None
            self.prefill(
                q, plan.prefill_tiles, plan.prefill_blocks, k_blocks, v_blocks, out, scale, window
            )
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """The tensors-only decode entry (AttentionBackend.decode): capturable."""
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        self.decode_into(q, k_blocks, v_blocks, block_table, context_lens, out, scale, window)
        return out

    def decode_into(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float | None = None,
        window: int | None = None,
    ) -> None:
        """Writes out[:num_seqs] (one row per block-table row) from q[:num_seqs]; allocates
        only the partials, whose sizes follow the shapes."""
        self._kernels.decode_into(
            q, k_blocks, v_blocks, block_table, context_lens, out,
            self.partition_size, self.decode_tile, scale, window,
        )  # fmt: skip

    def prefill(
        self,
        q: torch.Tensor,
        tiles: torch.Tensor,
        blocks: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        out: torch.Tensor,
        scale: float | None = None,
        window: int | None = None,
    ) -> None:
        """Writes the rows of every prefill chunk named in `tiles` (see `plan`)."""
        self._kernels.prefill_into(
            q, tiles, blocks, k_blocks, v_blocks, out, self.block_m, self.block_n, scale, window
        )
