"""The ModelRunner: persistent step buffers, backend choice, tokens per sampling chunk."""

from __future__ import annotations

import pytest
import torch

from radixserve.model import kernels
from radixserve.model.attention import (
    CpuPagedBackend,
    SdpaBackend,
    kv_dtype_problem,
    select_backend,
)
from radixserve.model.batch import SeqChunk, StepBuffers, build_batch
from radixserve.model.runner import ModelRunner, bucket_for, graph_buckets
from radixserve.model.weights import quantize_model
from tests.support.models import ARCHITECTURES
from tests.support.steps import run_step

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
    # float32 on the CPU: our paged kernel (the kernels build on every machine the suite runs)
    assert isinstance(select_backend("auto", CPU, torch.float32), CpuPagedBackend)
    assert isinstance(select_backend("cpu", CPU, torch.float32), CpuPagedBackend)
    with pytest.raises(ValueError, match="float32"):
        select_backend("cpu", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", CPU, torch.float32)
    # K/V stored in 16 bits for a float32 model: our kernels and SDPA convert as they read.
    for kv in (torch.bfloat16, torch.float16):
        assert isinstance(select_backend("auto", CPU, torch.float32, kv), CpuPagedBackend)
        assert isinstance(select_backend("sdpa", CPU, torch.float32, kv), SdpaBackend)


def test_the_triton_backend_takes_k_v_in_the_model_dtype_only() -> None:
    cuda = torch.device("cuda")
    assert kv_dtype_problem("triton", cuda, torch.bfloat16, torch.bfloat16) is None
    problem = kv_dtype_problem("triton", cuda, torch.bfloat16, torch.float16)
    assert problem is not None and "--attention-backend sdpa" in problem
    assert kv_dtype_problem("sdpa", cuda, torch.bfloat16, torch.float16) is None
    assert kv_dtype_problem("auto", CPU, torch.float32, torch.bfloat16) is None


def test_run_returns_a_token_for_each_chunk_that_samples(tiny_pair) -> None:
    _, model = tiny_pair
    runner = ModelRunner(model, 16, 4, max_num_seqs=4, max_num_batched_tokens=32)
    a, b = [1, 2, 3, 4, 5], [9, 8, 7]
    chunks = [SeqChunk(a, 0, [0, 1]), SeqChunk(b, 0, [2], need_logits=False)]
    res = run_step(runner, chunks, keep_logits=True)
    nxt, logits = res[0].token_id, res[0].logits
    assert nxt is not None and logits is not None and nxt == int(logits.argmax())
    assert res[1].token_id is None and res[1].logits is None
    assert run_step(runner, [SeqChunk([nxt], 5, [0, 1])])[0].token_id is not None


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
            run_step(runner, [SeqChunk(s, 0, t)])
        chunks = [SeqChunk([3], len(s), t) for s, t in zip(seqs, tables, strict=True)]
        res = run_step(runner, chunks, keep_logits=True)
        outs.append(torch.stack([res[i].logits for i in range(4)]))
    assert (outs[0] - outs[1]).abs().max() <= 1e-4


def test_graph_buckets_cover_every_batch_size_with_the_smallest_bucket() -> None:
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(1) == [1]
    for max_seqs in (1, 3, 8, 20, 64):
        buckets = graph_buckets(max_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_seqs
        for n in range(1, max_seqs + 1):
            size = bucket_for(n, buckets)
            assert size is not None and size >= n
            assert all(b < n for b in buckets if b < size)  # no smaller bucket holds n
        assert bucket_for(max_seqs + 1, buckets) is None


def _decode_inputs(runner: ModelRunner, chunks: list[SeqChunk]) -> tuple[torch.Tensor, ...]:
    batch = build_batch(chunks, runner.block_size, CPU, runner.buffers)
    n, b = len(chunks), runner.buffers
    assert batch.decode is not None and batch.input_ids.data_ptr() == b.input_ids.data_ptr()
    return (
        b.input_ids[:n],
        b.positions[:n],
        b.slot_mapping[:n],
        b.block_table[:n],  # the buffer's full width, as a captured graph reads it
        b.context_lens[:n],
    )


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
def test_decode_entry_equals_the_general_forward(tiny_pair, backend: str) -> None:
    """`DecoderModel.decode` (tensors only, what a CUDA graph captures) gives the logits of the
    general forward for the same decode step, with padding rows riding along harmlessly."""
    _, model = tiny_pair
    seqs = [[(5 * i + j) % 97 for j in range(n)] for i, n in enumerate((6, 17, 3))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    runs = []
    for path in ("forward", "decode"):
        runner = ModelRunner(model, 32, 4, max_num_seqs=8, attention_backend=backend)
        for s, t in zip(seqs, tables, strict=True):
            run_step(runner, [SeqChunk(s, 0, t)])
        chunks = [SeqChunk([11], len(s), t) for s, t in zip(seqs, tables, strict=True)]
        if path == "forward":
            res = run_step(runner, chunks, keep_logits=True)
            runs.append(torch.stack([res[i].logits for i in range(3)]))
            continue
        pool_before = runner.kv_pool.k[:, :32].clone()
        inputs = _decode_inputs(runner, chunks)
        runner._pad_rows(3, 5)  # two padding rows, as a bucket of 5 would have
        b = runner.buffers
        padded = [t[:5] for t in (b.input_ids, b.positions, b.slot_mapping, b.block_table)]
        with torch.inference_mode():
            logits = model.decode(*padded, b.context_lens[:5], runner.kv_pool, runner.attn)
        runs.append(logits[:3])
        changed = (runner.kv_pool.k[:, :32] != pool_before).any(dim=(0, 2, 3, 4))
        written = {t[len(s) // 4] for s, t in zip(seqs, tables, strict=True)}
        assert set(changed.nonzero().flatten().tolist()) <= written  # padding: scratch only
        assert inputs[0].shape[0] == 3
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fused_cpu_layers_equal_the_torch_layers(tiny_pair_factory, arch: str) -> None:
    """Every architecture's layers give the same logits through our fused elementwise kernels
    as through torch's ops, for prefill chunks past the sliding window and a decode step."""
    _, model = tiny_pair_factory(arch=arch)
    layers = model.decoder_layers()
    assert all(layer.fused for layer in layers)  # float32 on the CPU with kernels built
    chunks = [SeqChunk(list(range(3, 40)), 0, list(range(10))), SeqChunk([4, 5], 0, [12])]
    outs = []
    try:
        for fused in (True, False):
            for layer in layers:
                layer.fused = fused
            runner = ModelRunner(model, 16, 4, max_num_batched_tokens=64)
            res = run_step(runner, chunks, keep_logits=True)
            step = run_step(runner, [SeqChunk([7], 37, list(range(10)))], keep_logits=True)
            outs.append(torch.stack([res[0].logits, res[1].logits, step[0].logits]))
    finally:
        for layer in layers:
            layer.fused = True
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_equals_eager_decode(tiny_pair_factory) -> None:
    _, model = tiny_pair_factory()
    model = model.to("cuda")
    model.prepare()
    seqs = [[(3 * i + j) % 89 for j in range(n)] for i, n in enumerate((9, 4, 21))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    outs = []
    for eager in (True, False):
        runner = ModelRunner(model, 32, 4, max_num_seqs=4, enforce_eager=eager)
        runner.warmup()
        assert runner.decode_mode == ("eager" if eager else "cuda-graphs")
        for s, t in zip(seqs, tables, strict=True):
            run_step(runner, [SeqChunk(s, 0, t)])
        rows = []
        for step in range(3):  # several replays: the graph reads the refilled buffers
            chunks = [
                SeqChunk([5 + step], len(s) + step, t) for s, t in zip(seqs, tables, strict=True)
            ]
            res = run_step(runner, chunks, keep_logits=True)
            rows.append(torch.stack([res[i].logits for i in range(3)]))
        outs.append(torch.stack(rows))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "arch,kind,kv_dtype",
    [("llama", k, d) for k in ("int4", "int8") for d in (torch.float32, torch.bfloat16)]
    + [(a, "int4", torch.float32) for a in ARCHITECTURES if a != "llama"],
)
def test_a_decode_step_in_one_kernel_call_equals_the_layer_by_layer_step(
    tiny_pair_factory, monkeypatch, arch: str, kind: str, kv_dtype: torch.dtype
) -> None:
    """A quantized float32 model on the CPU, of every architecture, runs a decode-only step's
    layers in one call of our `decode_layers` kernel; its logits and the K/V it writes equal
    the layer-by-layer path's (`DecoderModel.decode`) for the same step (contexts past the
    tiny configs' sliding window)."""
    _, dense = tiny_pair_factory(arch=arch)
    assert dense.decode_layer_weights() is None  # dense projections: layer by layer
    _, model = tiny_pair_factory(arch=arch, intermediate_size=128)
    quantize_model(model, kind)
    assert model.decode_layer_weights() is not None
    seqs = [[(5 * i + j) % 97 for j in range(n)] for i, n in enumerate((6, 17, 3))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    runner = ModelRunner(model, 32, 4, attention_backend="cpu", kv_cache_dtype=kv_dtype)
    for s, t in zip(seqs, tables, strict=True):
        run_step(runner, [SeqChunk(s, 0, t)])
    chunks = [SeqChunk([11], len(s), t) for s, t in zip(seqs, tables, strict=True)]
    pool = runner.kv_pool
    before = pool.k.clone(), pool.v.clone()
    calls: list[str] = []
    op = kernels.op
    monkeypatch.setattr(kernels, "op", lambda name: calls.append(name) or op(name))
    res = run_step(runner, chunks, keep_logits=True)
    assert calls == ["decode_layers", "rms_norm"]  # every layer, then the final norm
    one_call = torch.stack([res[i].logits for i in range(3)])
    written = pool.k.clone(), pool.v.clone()
    pool.k.copy_(before[0])
    pool.v.copy_(before[1])
    with torch.inference_mode():
        by_layer = model.decode(*_decode_inputs(runner, chunks), pool, runner.attn)
    torch.testing.assert_close(one_call, by_layer, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.k, written[0]) and torch.equal(pool.v, written[1])
    assert not torch.equal(pool.k, before[0])  # the step wrote its K
