"""The ModelRunner: persistent step buffers, backend choice, tokens per sampling chunk."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.attention import CpuPagedBackend, SdpaBackend, select_backend
from radixserve.model.batch import SeqChunk, StepBuffers, build_batch
from radixserve.model.runner import ModelRunner
from radixserve.model.sampling import SamplingRow

CPU = torch.device("cpu")


def test_batches_are_built_in_the_step_buffers_and_reuse_them() -> None:
    bufs = StepBuffers(max_tokens=16, max_seqs=4, max_blocks=8, device=CPU)
    chunks = [SeqChunk([5], 9, [3, 1, 2]), SeqChunk([1, 2, 3], 0, [0])]
    first = build_batch(chunks, 4, CPU, bufs)
    assert first.input_ids.tolist() == [5, 1, 2, 3]
    assert first.slot_mapping.tolist() == [2 * 4 + 1, 0, 1, 2]  # position 9: block 2, slot 1
    second = build_batch(chunks[:1], 4, CPU, bufs)
    for batch in (first, second):
        assert batch.input_ids.data_ptr() == bufs.input_ids.data_ptr()
        assert batch.slot_mapping.data_ptr() == bufs.slot_mapping.data_ptr()
        assert batch.decode is not None
        assert batch.decode.block_table.data_ptr() == bufs.block_table.data_ptr()
    assert second.decode is not None and second.decode.context_lens.tolist() == [10]


def test_a_step_larger_than_the_buffers_gets_its_own_tensors() -> None:
    bufs = StepBuffers(max_tokens=4, max_seqs=2, max_blocks=2, device=CPU)
    batch = build_batch([SeqChunk(list(range(6)), 0, [0, 1])], 4, CPU, bufs)
    assert batch.input_ids.data_ptr() != bufs.input_ids.data_ptr()
    assert batch.input_ids.tolist() == list(range(6))


def test_backend_selection() -> None:
    assert isinstance(select_backend("sdpa", CPU, torch.float32), SdpaBackend)
    assert isinstance(select_backend("auto", CPU, torch.bfloat16), SdpaBackend)
    assert isinstance(select_backend("auto", CPU, torch.float32), SdpaBackend)
    assert isinstance(select_backend("cpu", CPU, torch.float32), CpuPagedBackend)
    with pytest.raises(ValueError, match="float32"):
        select_backend("cpu", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", CPU, torch.float32)


def test_run_returns_a_token_for_each_chunk_that_samples(tiny_pair) -> None:
    _, model = tiny_pair
    runner = ModelRunner(model, 16, 4, max_num_seqs=4, max_num_batched_tokens=32)
    a, b = [1, 2, 3, 4, 5], [9, 8, 7]
    chunks = [SeqChunk(a, 0, [0, 1]), SeqChunk(b, 0, [2], need_logits=False)]
    res = runner.run(chunks, [SamplingRow(0.0), None], [True, False])
    assert set(res.token_ids) == {0} and set(res.logits) == {0}
    assert res.token_ids[0] == int(res.logits[0].argmax())
    nxt = res.token_ids[0]
    res2 = runner.run([SeqChunk([nxt], 5, [0, 1])], [SamplingRow(0.0)])
    assert set(res2.token_ids) == {0}


def test_batched_decode_through_the_runner_is_the_same_on_both_backends(tiny_pair) -> None:
    """Several sequences decoding together read their block tables out of the runner's
    persistent buffer (a strided view); both backends must see the same blocks."""
    _, model = tiny_pair
    seqs = [[(7 * i + j) % 101 for j in range(n)] for i, n in enumerate((5, 23, 9, 14))]
    outs = []
    for backend in ("sdpa", "cpu"):
        runner = ModelRunner(
            model, 48, 4, max_num_seqs=8, max_num_batched_tokens=64, attention_backend=backend
        )
        tables = [list(range(12 * i, 12 * i + 12))[::-1] for i in range(4)]  # scattered
        for s, t in zip(seqs, tables, strict=True):
            runner.run([SeqChunk(s, 0, t)], [SamplingRow(0.0)])
        chunks = [SeqChunk([3], len(s), t) for s, t in zip(seqs, tables, strict=True)]
        res = runner.run(chunks, [SamplingRow(0.0)] * 4, [True] * 4)
        outs.append(torch.stack([res.logits[i] for i in range(4)]))
    assert (outs[0] - outs[1]).abs().max() <= 1e-4
