"""The Triton attention backend against torch SDPA on the same paged pool.

The kernel tests run where the kernels can: compiled on a CUDA machine (plus a CUDA-graph
capture of the decode step), or in Triton's interpreter on CPU tensors when TRITON_INTERPRET=1
was set before triton was imported. Elsewhere one test reruns this file in a subprocess with
that variable set (setting it later in this process would not take: triton decides at import).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from radixserve.model import attention
from radixserve.model.attention import SdpaBackend, select_backend
from radixserve.model.batch import DecodeMeta, ForwardBatch, SeqChunk, StepBuffers, build_batch
from radixserve.values import ceil_div

TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "triton is not installed (pip install 'radixserve[gpu]')"
CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")
kernel_test = pytest.mark.skipif(
    not (CUDA or INTERPRETER),
    reason="no GPU: runs under TRITON_INTERPRET=1 in test_kernel_tests_pass_in_the_interpreter",
)
# What the interpreter rerun must pass, exactly: every test of this file but itself and the
# CUDA graph test (18 kernel tests, 4 others). Adding or removing a test changes it on purpose.
INTERPRETER_PASSES = 22
BS = 4  # tokens per pool block
H, KVH, D = 6, 2, 16  # GQA groups of 3 query heads (padded to 4 in the decode kernel)
NB = 40


@pytest.fixture(scope="module")
def tri() -> ModuleType:
    """radixserve.model.attention.triton, the backend's module (its kernels import triton;
    skips the test without it)."""
    if not TRITON:
        pytest.skip(NO_TRITON)
    importlib.import_module("radixserve.model.attention.triton_kernels")
    return importlib.import_module("radixserve.model.attention.triton")


@pytest.fixture(scope="module")
def tri_kernels() -> ModuleType:
    """radixserve.model.attention.triton_kernels (imports triton; skips the test without it)."""
    if not TRITON:
        pytest.skip(NO_TRITON)
    return importlib.import_module("radixserve.model.attention.triton_kernels")


@pytest.mark.slow  # ~25 s: a second pytest process, kernels in the interpreter
@pytest.mark.skipif(not TRITON, reason=NO_TRITON)
@pytest.mark.skipif(CUDA or INTERPRETER, reason="the kernel tests run in this process")
def test_kernel_tests_pass_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    report = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, report
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) == INTERPRETER_PASSES, report  # none went missing


def backend(tri: ModuleType) -> attention.AttentionBackend:
    """Small tiles and partitions, so tiny shapes still span several of each."""
    b: attention.AttentionBackend = tri.TritonPagedBackend(
        partition_size=16, decode_tile=8, prefill_block_m=16, prefill_block_n=16
    )
    return b


def pool(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, BS, KVH, D, generator=g).to(dtype)
    v = torch.randn(NB, BS, KVH, D, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def queries(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """q as the model hands it over: a head slice of a fused q/k projection (a strided view)."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(num_tokens, H + KVH, D, generator=g).to(dtype).to(DEVICE)
    return qk[:, :H]


def tables(lengths: list[int], seed: int = 2) -> list[list[int]]:
    """Each sequence's blocks, distinct and scattered over the pool."""
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(seed)).tolist()
    out, i = [], 0
    for n in lengths:
        nblk = ceil_div(n, BS)
        out.append(perm[i : i + nblk])
        i += nblk
    assert i <= NB
    return out


def reference(q, batch: ForwardBatch, k, v, window=None, scale=None) -> torch.Tensor:
    """SdpaBackend computed in float64 on the CPU from the same values."""
    f = torch.float64
    cpu = ForwardBatch(
        batch.input_ids.cpu(),
        batch.positions.cpu(),
        batch.slot_mapping.cpu(),
        None,
        [],
        batch.logits_rows.cpu(),
        batch.logits_chunk_index,
        batch.block_size,
    )
    if batch.decode is not None:
        d = batch.decode
        cpu.decode = DecodeMeta(d.num_seqs, d.block_table.cpu(), d.context_lens.cpu(), d.max_len)
    for p in batch.prefills:
        cpu.prefills.append(type(p)(p.token_start, p.num_tokens, p.context_len, p.block_ids.cpu()))
    sdpa = SdpaBackend()
    k, v = k.cpu().to(f), v.cpu().to(f)
    return sdpa.forward(q.cpu().to(f), cpu, sdpa.plan(cpu), k, v, window, scale)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def check(
    tri: ModuleType,
    chunks: list[SeqChunk],
    dtype: torch.dtype,
    bufs=None,
    window: int | None = None,
    scale: float | None = None,
) -> None:
    batch = build_batch(chunks, BS, DEVICE, bufs)
    k, v = pool(dtype)
    q = queries(batch.input_ids.shape[0], dtype)
    b = backend(tri)
    got = b.forward(q, batch, b.plan(batch), k, v, window, scale)
    assert got.dtype == dtype and got.shape == (q.shape[0], H * D)
    want = reference(q, batch, k, v, window, scale)
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= TOL[dtype], f"max abs diff {err}"


def decode_chunks(lengths: list[int]) -> list[SeqChunk]:
    """One new token per sequence at position len - 1 (so `len` tokens are attended)."""
    return [SeqChunk([1], n - 1, t) for n, t in zip(lengths, tables(lengths), strict=True)]


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_sdpa_from_one_token_to_several_partitions(tri, dtype) -> None:
    # 1 token; partial and full last blocks; 17 and 45 span 2 and 3 partitions of 16.
    check(tri, decode_chunks([1, 3, 4, 9, 17, 45]), dtype)


@kernel_test
def test_decode_reads_block_table_rows_through_a_strided_view(tri) -> None:
    bufs = StepBuffers(max_tokens=16, max_seqs=8, max_blocks=24, device=DEVICE)
    batch = build_batch(decode_chunks([5, 30, 12]), BS, DEVICE, bufs)
    assert batch.decode is not None and batch.decode.block_table.stride(0) == 24
    check(tri, decode_chunks([5, 30, 12]), torch.float32, bufs)


@kernel_test
def test_padded_decode_rows_do_not_fault_or_touch_real_rows(tri) -> None:
    """Graph padding: extra rows of context length 1 (or 0, or past the table) at block 0."""
    lengths = [7, 21]
    batch = build_batch(decode_chunks(lengths), BS, DEVICE)
    d = batch.decode
    assert d is not None
    cols = d.block_table.shape[1]
    table = torch.zeros(5, cols, dtype=torch.int32, device=DEVICE)
    table[:2] = d.block_table
    lens = torch.tensor(lengths + [1, 0, 10_000], dtype=torch.int32, device=DEVICE)
    padded = ForwardBatch(
        batch.input_ids, batch.positions, batch.slot_mapping,
        DecodeMeta(5, table, lens, max(lengths)), [], batch.logits_rows, [], BS,
    )  # fmt: skip
    k, v = pool(torch.float32)
    q = queries(5, torch.float32)
    b = backend(tri)
    got = b.forward(q, padded, b.plan(padded), k, v)
    want = reference(q[:2], batch, k, v)
    assert (got[:2].cpu().double() - want).abs().max().item() <= 1e-5
    assert torch.isfinite(got).all()
    assert (got[3] == 0).all()  # no context: zeros, not NaN
    # Row 2 attends block 0's first token only: softmax of one score is that token's V.
    first_v = v[0, 0].repeat_interleave(H // KVH, dim=0).reshape(-1)
    assert torch.allclose(got[2], first_v)


@kernel_test
def test_decode_over_a_full_width_table_reads_only_the_partitions_lengths_reach(tri) -> None:
    """As under graph capture: the table is as wide as the longest context allowed (here 6
    partitions), most of it unused; the partials of unreached partitions are never written."""
    lengths = [5, 30, 1]
    batch = build_batch(decode_chunks(lengths), BS, DEVICE)
    d = batch.decode
    assert d is not None
    wide = torch.zeros(3, 24, dtype=torch.int32, device=DEVICE)
    wide[:, : d.block_table.shape[1]] = d.block_table
    full = ForwardBatch(
        batch.input_ids, batch.positions, batch.slot_mapping,
        DecodeMeta(3, wide, d.context_lens, d.max_len), [], batch.logits_rows, [], BS,
    )  # fmt: skip
    k, v = pool(torch.float32)
    q = queries(3, torch.float32)
    b = backend(tri)
    got = b.forward(q, full, b.plan(full), k, v)
    assert (got.cpu().double() - reference(q, batch, k, v)).abs().max().item() <= 1e-5


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_without_a_cached_prefix_matches_sdpa(tri, dtype) -> None:
    check(tri, [SeqChunk(list(range(21)), 0, tables([21])[0])], dtype)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_over_a_cached_prefix_matches_sdpa(tri, dtype) -> None:
    # 13 tokens cached (a partial block), 19 new: two query tiles, causal across both.
    check(tri, [SeqChunk(list(range(19)), 13, tables([32])[0])], dtype)


@kernel_test
def test_several_prefill_chunks_run_in_one_launch(tri) -> None:
    t = tables([8, 30, 5])
    chunks = [SeqChunk([1] * 8, 0, t[0]), SeqChunk([2] * 6, 24, t[1]), SeqChunk([3] * 5, 0, t[2])]
    batch = build_batch(chunks, BS, DEVICE)
    plan = backend(tri).plan(batch)
    assert plan.prefill_tiles is not None and plan.prefill_tiles.shape == (3, 4)
    check(tri, chunks, torch.float32)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_decode_and_prefill_batch_matches_sdpa(tri, dtype) -> None:
    t = tables([11, 26, 40, 9])
    chunks = [
        SeqChunk([4] * 7, 19, t[1]),  # prefill over a cached prefix
        SeqChunk([5], 10, t[0]),  # decode
        SeqChunk([6] * 9, 0, t[3]),  # fresh prefill
        SeqChunk([7], 39, t[2]),  # decode across 3 partitions
    ]
    check(tri, chunks, dtype)


@kernel_test
@pytest.mark.parametrize("window", [5, 13])
def test_sliding_window_and_softmax_scale_match_sdpa(tri, window: int) -> None:
    """Windows shorter than a key tile and longer, starting inside blocks and partitions:
    decode rows and prefill chunks (fresh and over a cached prefix) see their last `window`
    keys only."""
    t = tables([11, 26, 40, 9])
    chunks = [
        SeqChunk([4] * 7, 19, t[1]),
        SeqChunk([5], 10, t[0]),
        SeqChunk([6] * 9, 0, t[3]),
        SeqChunk([7], 39, t[2]),
    ]
    check(tri, chunks, torch.float32, window=window, scale=0.3)


@kernel_test
def test_decode_only_plan_does_no_work(tri) -> None:
    batch = build_batch(decode_chunks([3, 8]), BS, DEVICE)
    plan = backend(tri).plan(batch)
    assert plan.prefill_tiles is None and plan.prefill_blocks is None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_is_captured_in_a_cuda_graph_and_replays_new_lengths(tri) -> None:
    """Capture one decode over persistent full-width buffers, then rewrite lengths and block
    ids in place: the replay must match SDPA for the new contents (nothing read on the host)."""
    b = tri.TritonPagedBackend()
    k, v = pool(torch.bfloat16)
    bufs = StepBuffers(max_tokens=8, max_seqs=8, max_blocks=12, device=DEVICE)
    meta = DecodeMeta(4, bufs.block_table[:4], bufs.context_lens[:4], 0)
    ids = torch.zeros(4, dtype=torch.long, device=DEVICE)
    static = ForwardBatch(ids, ids, ids, meta, [], ids, [], BS)

    def fill(lengths: list[int]) -> ForwardBatch:
        batch = build_batch(decode_chunks(lengths), BS, DEVICE)
        assert batch.decode is not None
        meta.block_table.zero_()
        meta.block_table[:, : batch.decode.block_table.shape[1]] = batch.decode.block_table
        meta.context_lens.copy_(batch.decode.context_lens)
        return batch

    fill([5, 9, 3, 2])
    q_static = queries(4, torch.bfloat16).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) off the capture
        b.forward(q_static, static, b.plan(static), k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b.forward(q_static, static, b.plan(static), k, v)
    second = fill([40, 17, 1, 33])
    q_static.copy_(queries(4, torch.bfloat16, seed=7))
    graph.replay()
    want = reference(q_static, second, k, v)
    assert (out.cpu().double() - want).abs().max().item() <= 2e-2


def test_auto_is_not_triton_on_cpu_and_triton_where_cuda_can_run_it(tri, monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu, torch.bfloat16), SdpaBackend)
    assert select_backend("auto", cpu, torch.float32).name == "cpu"
    monkeypatch.setattr(tri, "triton_unavailable", lambda device: None)
    got = select_backend("auto", torch.device("cuda"), torch.bfloat16)
    assert isinstance(got, tri.TritonPagedBackend)
    monkeypatch.setattr(tri, "triton_unavailable", lambda device: "no")
    assert isinstance(select_backend("auto", torch.device("cuda"), torch.bfloat16), SdpaBackend)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(
    tri, tri_kernels, monkeypatch
) -> None:
    monkeypatch.setattr(tri_kernels, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cpu"), torch.float32)
    if not CUDA:  # with the interpreter the kernels do run on CPU tensors
        monkeypatch.setattr(tri_kernels, "INTERPRETED", True)
        assert isinstance(
            select_backend("triton", torch.device("cpu"), torch.float32), tri.TritonPagedBackend
        )


def test_triton_without_the_package_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "radixserve.model.attention.triton_kernels", raising=False)
    monkeypatch.delattr(attention, "triton_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(ValueError, match=r"needs the triton package.*radixserve\[gpu\]"):
        select_backend("triton", torch.device("cuda"), torch.bfloat16)
    assert isinstance(select_backend("auto", torch.device("cuda"), torch.bfloat16), SdpaBackend)


def test_the_flag_and_the_preflight_know_triton(monkeypatch) -> None:
    import argparse

    from radixserve.errors import ConfigError
    from radixserve.values import ATTENTION_BACKENDS

    assert "triton" in ATTENTION_BACKENDS
    monkeypatch.setattr(attention, "triton_unavailable", lambda device: "reason X")
    from radixserve import preflight

    args = argparse.Namespace(
        model=None,
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        kv_cache_memory="64MiB",
    )
    with pytest.raises(ConfigError, match="triton cannot run here: reason X"):
        preflight.check_engine_args(args)


@kernel_test
def test_the_model_gives_the_same_logits_on_triton_and_sdpa(tri, tiny_pair) -> None:
    """A tiny Llama through the runner: a prompt, a cached-prefix chunk, then batched decode."""
    from radixserve.model.runner import ModelRunner
    from tests.support.steps import run_step

    _, model = tiny_pair
    model = model.to(DEVICE)
    model.prepare()
    logits = []
    for name in ("sdpa", "triton"):
        runner = ModelRunner(model, 24, 4, max_num_seqs=4, attention_backend=name)
        assert runner.attn.name == name
        a, b = list(range(3, 20)), list(range(40, 49))
        ta, tb = list(range(0, 8)), list(range(23, 15, -1))
        run_step(runner, [SeqChunk(a[:10], 0, ta), SeqChunk(b, 0, tb)])
        step = run_step(runner, [SeqChunk(a[10:], 10, ta), SeqChunk([5], 9, tb)], True)
        dec = run_step(runner, [SeqChunk([7], 17, ta), SeqChunk([8], 10, tb)], True)
        logits.append(torch.stack([r[i].logits for r in (step, dec) for i in (0, 1)]))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-4


@kernel_test
def test_default_tiles_at_the_default_models_head_shape(tri) -> None:
    """The sizes a GPU runs (16-token blocks, partitions of 256, 64x64 prefill tiles) at
    SmolLM2-135M's heads (9 query, 3 KV, head_dim 64): decode over 3 partitions, a 2-tile
    chunk over a cached prefix, a fresh chunk."""
    bs, h, kvh, d, nb = 16, 9, 3, 64, 64
    g = torch.Generator().manual_seed(3)
    k = torch.randn(nb, bs, kvh, d, generator=g).to(DEVICE)
    v = torch.randn(nb, bs, kvh, d, generator=g).to(DEVICE)
    t = torch.randperm(nb, generator=g).tolist()
    chunks = [
        SeqChunk([1], 599, t[:38]),
        SeqChunk([2], 16, t[38:40]),
        SeqChunk([3] * 70, 30, t[40:47]),
        SeqChunk([4] * 5, 0, t[47:48]),
    ]
    batch = build_batch(chunks, bs, DEVICE)
    q = torch.randn(batch.input_ids.shape[0], h + kvh, d, generator=g).to(DEVICE)[:, :h]
    b = tri.TritonPagedBackend()
    got = b.forward(q, batch, b.plan(batch), k, v)
    want = reference(q, batch, k, v)
    assert (got.cpu().double() - want).abs().max().item() <= 1e-5
