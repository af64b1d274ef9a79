"""`--attention-backend cpu`: radixserve's C++ kernels read K/V from the pool's blocks in place
(float32 models on the CPU; `auto` there when the kernels load). On the `amx-bf16` prefill
path (kernels/matrix.py), prefill chunks attend on AMX tiles in bfloat16."""

from __future__ import annotations

import math

import torch

from radixserve.model import kernels
from radixserve.model.attention.base import AttentionPlan, BackendCapabilities, prefill_attention
from radixserve.model.batch import ForwardBatch
from radixserve.model.kernels.matrix import PrefillPath


class CpuPagedBackend:
    """Attention by our kernels, straight from the pool's blocks (no per-layer copy of each
    sequence's context): decode rows, and prefill chunks causal over their cached prefix
    (head sizes that are not a multiple of 16 take `sdpa`'s prefill). float32 models on CPU,
    K/V stored in float32, bfloat16 or float16 (converted to float32 as they are read).

    With `prefill_path` amx-bf16 (the runner sets the model's), chunks of 8+ tokens with a
    head size that is a multiple of 64 attend on AMX tiles: Q, K, V and the probabilities
    rounded to bfloat16, sums and softmax in float32. Decode rows stay float32."""

    prefill_path = PrefillPath.FP32

    name = "cpu"
    capabilities = BackendCapabilities(
        devices=("cpu",),
        dtypes=(torch.float32,),
        kv_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        reads_pool_in_place=True,
        fused_decode_step=True,
        narrows_last_layer=True,
        graph_capturable=False,
    )

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Not float32 on the CPU, or our kernels do not build here (builds them once)."""
        if not cls.capabilities.serves(device, dtype):
            return "runs float32 models on the CPU only"
        if not kernels.load():
            return "needs radixserve's CPU kernels"
        return None

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
        """Nothing to plan: the kernels read the batch's block tables directly."""
        return AttentionPlan()

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
        """q [T, H, D] -> [T, H * D]: decode rows, then each prefill chunk, by our kernels
        (which start each query's keys at its window's first, with a window)."""
        num_tokens, num_heads, head_dim = q.shape
        d = batch.decode
        if d is not None and not batch.prefills:  # a decode step: no copy into a wider out
            return self.decode(q, k_blocks, v_blocks, d.block_table, d.context_lens, window, scale)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
        if d is not None:
            b = d.num_seqs
            out[:b] = self.decode(
                q[:b], k_blocks, v_blocks, d.block_table, d.context_lens, window, scale
            )
        if head_dim % 16:
            prefill_attention(q, batch, k_blocks, v_blocks, out, window, scale)
            return out
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        path = self.prefill_path
        unit = path.attention_unit if head_dim % 64 == 0 else 0
        for p in batch.prefills:
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            if unit and p.num_tokens >= path.attention_min_tokens:
                kernels.op("paged_prefill_attention_bf16")(
                    q[rows], k_blocks, v_blocks, p.block_ids, p.context_len, sm_scale, out[rows],
                    unit, window or 0,
                )  # fmt: skip
                continue
            kernels.op("paged_prefill_attention")(
                q[rows], k_blocks, v_blocks, p.block_ids, p.context_len, sm_scale, out[rows],
                window or 0,
            )  # fmt: skip
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
        """One query per sequence over its blocks in place (AttentionBackend.decode)."""
        b, num_heads, head_dim = q.shape
        out = torch.empty(b, num_heads, head_dim, dtype=q.dtype, device=q.device)
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        kernels.op("paged_decode_attention")(
            q, k_blocks, v_blocks, block_table, context_lens, sm_scale, out, window or 0
        )
        return out.view(b, num_heads * head_dim)
