"""The ModelRunner: everything an engine does on the device, behind one call per step.

It owns the model, the paged KV pool, the step's input buffers (allocated once, refilled in
place), the attention backend, and batched sampling. The engine hands it the step's chunks
and how to sample each row; it returns the sampled token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.model.attention import select_backend
from radixserve.model.batch import SeqChunk, StepBuffers, build_batch
from radixserve.model.kv_pool import KVPool
from radixserve.model.llama import LlamaModel
from radixserve.model.sampling import SamplingRow, sample_rows


@dataclass
class StepResult:
    """Sampled token per chunk that asked for one, and logits rows where asked for."""

    token_ids: dict[int, int] = field(default_factory=dict)  # chunk index -> token id
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk index -> [V] float32


class ModelRunner:
    """Runs forward steps of `model` over a KV pool of `num_blocks` x `block_size` tokens."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        p = next(model.parameters())
        self.model = model
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.kv_pool = KVPool(model.config, num_blocks, block_size, self.dtype, self.device)
        self.attn = select_backend(attention_backend, self.device, self.dtype)
        self.enforce_eager = enforce_eager
        max_len = max_model_len or model.config.max_position_embeddings
        self.buffers = StepBuffers(
            max(max_num_batched_tokens, max_num_seqs),
            max_num_seqs,
            -(-max_len // block_size),
            self.device,
        )

    def run(
        self,
        chunks: Sequence[SeqChunk],
        sampling: Sequence[SamplingRow | None],
        keep_logits: Sequence[bool] | None = None,
    ) -> StepResult:
        """One forward step over `chunks`; each chunk with `need_logits` gets a token drawn
        as `sampling[i]` says, and its logits row too where `keep_logits[i]`."""
        batch = build_batch(chunks, self.block_size, self.device, self.buffers)
        logits = self.model(batch, self.kv_pool, self.attn)
        result = StepResult()
        if not batch.logits_chunk_index:
            return result
        rows: list[SamplingRow] = []
        for i in batch.logits_chunk_index:
            row = sampling[i]
            rows.append(row if row is not None else SamplingRow(temperature=0.0))
        ids = sample_rows(logits, rows).tolist()  # the step's one device-to-host copy of ids
        for r, i in enumerate(batch.logits_chunk_index):
            result.token_ids[i] = ids[r]
            if keep_logits is not None and keep_logits[i]:
                result.logits[i] = logits[r].cpu()
        return result
