"""radixserve's fused CPU kernels equal the torch code they replace."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import kernels
from radixserve.model.attention import CpuPagedBackend, SdpaBackend
from radixserve.model.batch import SeqChunk, build_batch
from radixserve.model.decoder import DecoderModel
from radixserve.model.decoder_layer import DecoderLayer
from radixserve.model.layers import apply_rope, rms_norm
from radixserve.model.weights import quantize_model
from radixserve.values import ceil_div

ops = torch.ops.radixserve
# K/V pool element types (--kv-cache-dtype); the kernels compute in float32 either way.
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built_kernels() -> None:
    assert kernels.load(), "the CPU kernels must build on this machine (a compiler and ninja)"


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_equals_torch(rows: int) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96) * 3, torch.randn(96)
    out = torch.empty_like(x)
    ops.rms_norm(x, w, 1e-5, out)
    torch.testing.assert_close(out, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rope_kv_write_rotates_q_and_k_and_writes_k_and_v(rows: int, kv_dtype: torch.dtype) -> None:
    """K and V land in the pool rounded to its dtype exactly as torch's .to() rounds."""
    torch.manual_seed(rows)
    heads, kv_heads, d, block, blocks = 6, 2, 16, 4, 20
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    angles = torch.randn(rows, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm((blocks + 1) * block)[:rows]
    k_pool = torch.zeros(blocks + 1, block, kv_heads, d, dtype=kv_dtype)
    v_pool = torch.zeros_like(k_pool)
    ref = qkv.clone()
    ops.rope_kv_write(qkv, cos, sin, slots, k_pool, v_pool, heads)
    qk = apply_rope(ref[:, : (heads + kv_heads) * d].view(rows, -1, d), cos, sin)
    torch.testing.assert_close(qkv[:, : heads * d], qk[:, :heads].reshape(rows, -1))
    k_want = qk[:, heads:]
    v_want = ref[:, (heads + kv_heads) * d :].view(rows, kv_heads, d)
    exact = {"rtol": 0.0, "atol": 0.0} if kv_dtype != torch.float32 else {}
    torch.testing.assert_close(k_pool.view(-1, kv_heads, d)[slots], k_want.to(kv_dtype), **exact)
    torch.testing.assert_close(v_pool.view(-1, kv_heads, d)[slots], v_want.to(kv_dtype), **exact)
    untouched = torch.ones(k_pool.view(-1, kv_heads, d).shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool.view(-1, kv_heads, d)[untouched].any()


def test_rope_kv_write_norms_each_q_and_k_head_before_rotating() -> None:
    """Qwen3 / Gemma 3: RMSNorm over each head (q heads by q_norm, k heads by k_norm), then
    RoPE; V is written as it is."""
    torch.manual_seed(1)
    rows, heads, kv_heads, d, block = 5, 4, 2, 32, 4
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d) * 3
    angles = torch.randn(rows, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_norm, k_norm = torch.randn(d), torch.randn(d)
    slots = torch.arange(rows)
    k_pool = torch.zeros(3, block, kv_heads, d)
    v_pool = torch.zeros_like(k_pool)
    ref = qkv.clone()
    ops.rope_kv_write(qkv, cos, sin, slots, k_pool, v_pool, heads, q_norm, k_norm, 1e-6)
    qk = ref[:, : (heads + kv_heads) * d].view(rows, -1, d)
    weights = torch.cat([q_norm.expand(heads, d), k_norm.expand(kv_heads, d)])
    qk = apply_rope(rms_norm(qk, weights, 1e-6), cos, sin)
    torch.testing.assert_close(qkv[:, : heads * d], qk[:, :heads].reshape(rows, -1))
    torch.testing.assert_close(k_pool.view(-1, kv_heads, d)[slots], qk[:, heads:])
    v_want = ref[:, (heads + kv_heads) * d :].view(rows, kv_heads, d)
    torch.testing.assert_close(v_pool.view(-1, kv_heads, d)[slots], v_want)


def test_silu_mul_equals_torch() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * 70) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero inputs
    out = torch.empty(9, 70)
    ops.silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act,code", [("silu", 0), ("tanh", 1)])
def test_gate_act_mul_equals_torch(act: str, code: int) -> None:
    """SwiGLU's and GeGLU's (tanh GELU, transformers' gelu_pytorch_tanh) gate times up."""
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * 70) * 4
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -9.0, 9.0])  # saturated, zero
    out = torch.empty(9, 70)
    ops.gate_act_mul(gate_up, out, code)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    # torch's tanh GELU loses digits to 1 + tanh(u) for negative inputs (ours: x sigmoid(2u)).
    torch.testing.assert_close(out, want * up, rtol=1e-5, atol=1e-6 if act == "silu" else 1e-5)


@pytest.mark.parametrize("window", [None, 7, 70])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 12])  # 12: not a multiple of 8 (scalar path)
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_decode_attention_equals_sdpa_over_the_same_blocks(
    head_dim: int, block_size: int, kv_dtype: torch.dtype, window: int | None
) -> None:
    """Contexts from 1 token to several of the kernel's chunks, GQA, scattered blocks, and
    q rows that are the first columns of a wider (fused qkv) tensor; pools of each K/V dtype
    (the reference attends over the same rounded values in float32); with sliding windows
    shorter and longer than a chunk, starting inside a block."""
    torch.manual_seed(head_dim + block_size)
    heads, kv_heads = 9, 3
    lens = [1, 7, block_size, block_size + 1, 63, 64, 65, 300]
    width = max(ceil_div(n, block_size) for n in lens)
    nblocks = len(lens) * width + 1
    k_blocks = torch.randn(nblocks, block_size, kv_heads, head_dim).to(kv_dtype)
    v_blocks = torch.randn_like(k_blocks)
    table = torch.randperm(nblocks)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    wide = torch.randn(len(lens), heads * head_dim + 40)
    q = wide[:, : heads * head_dim].view(len(lens), heads, head_dim)
    got = CpuPagedBackend().decode(q, k_blocks, v_blocks, table, context_lens, window, 0.3)
    want = SdpaBackend().decode(
        q, k_blocks.float(), v_blocks.float(), table, context_lens, window, 0.3
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Row 0 attends to one token: its output is that token's V, head group by head group.
    first = v_blocks[table[0, 0], 0].float().repeat_interleave(heads // kv_heads, dim=0)
    torch.testing.assert_close(got[0].view(heads, head_dim), first)
    assert math.isfinite(float(got.abs().sum()))


@pytest.mark.parametrize("window", [None, 9, 100])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_prefill_attention_equals_sdpa_over_the_same_blocks(
    heads: int, kv_heads: int, block_size: int, kv_dtype: torch.dtype, window: int | None
) -> None:
    """Chunks that start their sequence and chunks over a cached prefix, short and long (up to
    64 new tokens in one query tile, 100 in 32-token tiles, 64-key tiles, a 2-token chunk over
    300 cached tokens cut into 1-token query tiles), scattered blocks, q rows inside a
    wider (fused qkv) tensor, decode rows in the same step, and pools of each K/V dtype; with
    sliding windows shorter than a key tile and longer than some chunks."""
    torch.manual_seed(heads * block_size)
    head_dim = 64
    # (new tokens, cached); 1: decode
    shapes = [(50, 0), (2, 300), (37, 70), (1, 20), (17, 17), (100, 40)]
    nblocks = sum(ceil_div(start + n, block_size) for n, start in shapes) + 3
    order = torch.randperm(nblocks).tolist()
    chunks = []
    for i, (n, start) in enumerate(shapes):
        need = ceil_div(start + n, block_size)
        chunks.append(SeqChunk([i + 1] * n, start, order[:need]))
        order = order[need:]
    batch = build_batch(chunks, block_size)
    k_blocks = torch.randn(nblocks, block_size, kv_heads, head_dim).to(kv_dtype)
    v_blocks = torch.randn_like(k_blocks)
    tokens = batch.input_ids.shape[0]
    wide = torch.randn(tokens, heads * head_dim + 24)
    q = wide[:, : heads * head_dim].view(tokens, heads, head_dim)
    cpu, sdpa = CpuPagedBackend(), SdpaBackend()
    got = cpu.forward(q, batch, cpu.plan(batch), k_blocks, v_blocks, window, 0.2)
    f64 = torch.float64
    k64, v64 = k_blocks.to(f64), v_blocks.to(f64)
    want = sdpa.forward(q.to(f64), batch, sdpa.plan(batch), k64, v64, window, 0.2)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9, 100])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 1), (4, 4)])
def test_paged_prefill_attention_gives_a_row_the_same_bits_in_any_chunk(
    heads: int, kv_heads: int, kv_dtype: torch.dtype, window: int | None
) -> None:
    """A token's attention does not depend on how many new tokens share its chunk: the last
    rows of a 100-, 84- or 40-token chunk equal those rows as a shorter chunk over the cached
    rest, bit for bit, so a cache hit's rows are the cold run's (on an int8 path a last-bit
    difference would change an activation's code). A 1-token chunk is a decode row: another
    kernel."""
    torch.manual_seed(heads + kv_heads)
    block_size, head_dim, context = 16, 64, 300
    blocks = torch.randperm(ceil_div(context, block_size) + 2)[: ceil_div(context, block_size)]
    k_blocks = torch.randn(len(blocks) + 2, block_size, kv_heads, head_dim).to(kv_dtype)
    v_blocks = torch.randn_like(k_blocks)
    q = torch.randn(context, heads, head_dim)
    cpu = CpuPagedBackend()

    def attend(new: int) -> torch.Tensor:
        batch = build_batch([SeqChunk([1] * new, context - new, blocks.tolist())], block_size)
        rows = q[context - new :].contiguous()
        return cpu.forward(rows, batch, cpu.plan(batch), k_blocks, v_blocks, window, 0.125)

    for longer, shorter in [(100, 36), (84, 36), (84, 3), (40, 12), (300, 2)]:
        assert torch.equal(attend(longer)[-shorter:], attend(shorter)), (longer, shorter)


def test_paged_prefill_attention_first_token_sees_only_itself() -> None:
    torch.manual_seed(0)
    k_blocks = torch.randn(4, 16, 2, 64)
    v_blocks = torch.randn_like(k_blocks)
    batch = build_batch([SeqChunk([1] * 20, 0, [2, 0])], 16)
    q = torch.randn(20, 4, 64)
    cpu = CpuPagedBackend()
    got = cpu.forward(q, batch, cpu.plan(batch), k_blocks, v_blocks).view(20, 4, 64)
    torch.testing.assert_close(got[0], v_blocks[2, 0].repeat_interleave(2, dim=0))
    assert math.isfinite(float(got.abs().sum()))


def _quantized_model(tiny_pair_factory, kind: str, arch: str = "llama") -> DecoderModel:
    _, model = tiny_pair_factory(arch=arch, intermediate_size=128)  # every projection quantizable
    quantize_model(model, kind)
    return model


def _optional(t: torch.Tensor | None) -> torch.Tensor:
    return t if t is not None else torch.empty(0)


def _named_weights(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """A layer's weights by the names of the kernels' table, written out here as the spec
    (a part the architecture lacks: an empty tensor)."""
    named = {"input_norm": layer.input_norm, "post_norm": layer.post_norm}
    for norm in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
        named[norm] = _optional(getattr(layer, norm))
    named["qkv.bias"] = _optional(layer.qkv_bias)
    for proj in ("qkv", "o", "gate_up", "down"):
        w = getattr(layer, f"{proj}_lin").weight
        named |= {f"{proj}.qs": w.qs, f"{proj}.scale": w.scale}
        named[f"{proj}.minv"] = _optional(w.minv)
        named[f"{proj}.kind"] = w.kernel_layout()
    return named


def test_decode_layer_weight_names_name_each_norm_bias_and_projection_part_once() -> None:
    """The kernels' table (its order is the C++ enum's, written nowhere else)."""
    names = kernels.decode_layer_weight_names()
    fields = ("qs", "scale", "minv", "kind")
    parts = [f"{p}.{f}" for p in ("qkv", "o", "gate_up", "down") for f in fields]
    norms = {"input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"}
    assert len(names) == 23 and set(names) == {*norms, "qkv.bias", *parts}


def _named_layers(tiny_pair_factory, kind: str) -> list[dict[str, torch.Tensor]]:
    return [
        _named_weights(layer)
        for layer in _quantized_model(tiny_pair_factory, kind).decoder_layers()
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_decode_layer_weights_follow_the_kernels_named_table(
    tiny_pair_factory, kind: str, arch: str
) -> None:
    """The model's list for `decode_layers` holds, at each layer's slot of each name, the
    layer's tensor of that name (int8: an empty tensor for the mins; a part the architecture
    lacks: an empty tensor)."""
    model = _quantized_model(tiny_pair_factory, kind, arch)
    weights = model.decode_layer_weights()
    names = kernels.decode_layer_weight_names()
    layers = model.decoder_layers()
    assert weights is not None and len(weights) == len(layers) * len(names)
    for i, layer in enumerate(layers):
        for slot, name in enumerate(names):
            got, want = weights[i * len(names) + slot], _named_weights(layer)[name]
            same = got is want or (got.numel() == 0 and want.numel() == 0)
            assert same or (name.endswith(".kind") and torch.equal(got, want)), (i, name)


def test_a_layer_missing_a_weight_fails_naming_it(tiny_pair_factory) -> None:
    layers = _named_layers(tiny_pair_factory, "int4")
    del layers[1]["o.scale"]
    with pytest.raises(
        kernels.LayerWeightsError, match=r"layer 1's .* missing 'o.scale' \(slot \d+\)"
    ):
        kernels.order_layer_weights(layers)


def test_a_misnamed_weight_fails_naming_both_names(tiny_pair_factory) -> None:
    layers = _named_layers(tiny_pair_factory, "int4")
    layers[0]["o.scales"] = layers[0].pop("o.scale")
    with pytest.raises(kernels.LayerWeightsError, match=r"missing 'o.scale' .* table: 'o.scales'"):
        kernels.order_layer_weights(layers)


def test_decode_layers_names_the_slot_of_a_weight_of_the_wrong_kind(tiny_pair_factory) -> None:
    """A list in another order than the table's (here qkv's codes and scales swapped) fails
    before any computation, naming the slot; so does a list of the wrong length."""
    model = _quantized_model(tiny_pair_factory, "int4")
    weights = kernels.order_layer_weights(_named_weights(x) for x in model.decoder_layers())
    names = kernels.decode_layer_weight_names()
    a, b = len(names) + names.index("qkv.qs"), len(names) + names.index("qkv.scale")
    weights[a], weights[b] = weights[b], weights[a]
    c = model.config
    h = torch.zeros(1, c.hidden_size)
    pools = torch.zeros(c.num_layers, 2, 4, c.num_kv_heads, c.head_dim)
    cos = sin = torch.zeros(1, 1, c.head_dim)
    ints = torch.zeros(1, 1, dtype=torch.int32)
    per_layer = torch.zeros(c.num_layers, dtype=torch.long)

    no_window = pools[:0]
    layer_pools = torch.arange(c.num_layers)

    def step(ws: list[torch.Tensor]) -> None:
        slots = torch.zeros(1, dtype=torch.long)
        ops.decode_layers(h, ws, cos, sin, slots, pools, pools.clone(), ints, ints[0],
                          per_layer, per_layer, c.num_heads, 1e-5, 0.25, 0, no_window,
                          no_window, slots, ints, layer_pools)  # fmt: skip

    slot = names.index("qkv.qs")
    with pytest.raises(RuntimeError, match=rf"layer 1's weight {slot} \(qkv.qs\) is a Float"):
        step(weights)
    with pytest.raises(RuntimeError, match="takes 23 weights per layer"):
        step(weights[:-1])


AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]


@pytest.mark.parametrize(
    "isa,want",
    [("", AVX2 + AVX512), ("avx512", AVX2 + AVX512), ("avx2", AVX2), ("portable", [])]
    + [("sse9", AVX2 + AVX512)],  # an unknown value: ignored (with a warning)
)
def test_cpu_isa_caps_the_instruction_set_flags(monkeypatch, isa: str, want: list[str]) -> None:
    """On an AVX-512 machine, RADIXSERVE_CPU_ISA=avx2 builds the kernels as an AVX2-only CPU
    (AMD Zen 3) runs them, and `portable` without vector flags (the plain C++ paths)."""
    cpu = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: cpu)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", isa)
    assert [f for f in kernels.compile_flags() if f.startswith("-m")] == want


def test_the_build_key_covers_every_source_and_header(tmp_path, monkeypatch) -> None:
    """Each file here holds kernels or helpers they inline: editing any one builds anew."""
    here = Path(kernels.__file__).parent
    sources = sorted(p.name for p in here.iterdir() if p.is_file() and p.suffix != ".py")
    assert {"cpu_kernels.cpp", "simd.h", "gemm.cpp", "attention.cpp", "layers.cpp"} <= set(sources)
    for name in sources:
        (tmp_path / name).write_bytes((here / name).read_bytes())
    monkeypatch.setattr(kernels, "_DIR", tmp_path)
    flags = kernels.compile_flags()
    keys = {kernels._build_key(flags)}
    for name in sources:
        with (tmp_path / name).open("a") as f:
            f.write("\n")
        keys.add(kernels._build_key(flags))
    assert len(keys) == len(sources) + 1
    assert kernels._build_key(flags + ["-DX"]) not in keys


def _this_build() -> Path:
    """The build directory of this process's kernels."""
    return kernels.kernel_cache_dir() / f"cpu-{kernels._build_key(kernels.compile_flags())}"


def test_a_build_killed_midway_does_not_block_the_next_load(tmp_path) -> None:
    """torch's build baton (a plain `lock` file) outlives a builder killed mid-build; without
    radixserve's own lock around builds, every later load waited on it forever."""
    if not kernels.load():
        pytest.skip("radixserve's CPU kernels do not build here")
    built = _this_build()
    copy = tmp_path / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "*.lock", kernels._BUILT))
    (copy / "lock").touch()  # as the killed build left it (not marked built)
    env = {**os.environ, "RADIXSERVE_KERNEL_CACHE_DIR": str(tmp_path)}
    code = "from radixserve.model import kernels; assert kernels.load()"
    subprocess.run([sys.executable, "-c", code], env=env, timeout=600, check=True)
    assert not (copy / "lock").exists()


def test_a_whole_build_loads_without_torchs_builder() -> None:
    """A build marked whole is loaded as it is: neither torch's extension builder (with
    setuptools, 0.14 s of every start) nor ninja runs."""
    if not kernels.load():
        pytest.skip("radixserve's CPU kernels do not build here")
    built = _this_build()
    assert (built / kernels._BUILT).exists()
    code = (
        "import sys; from radixserve.model import kernels; assert kernels.load(); "
        "kernels.op('q4_gemm'); print('torch.utils.cpp_extension' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path, monkeypatch) -> None:
    """The build files name sources by path: a second checkout sharing the first's directory
    would make each rebuild it on every alternate start."""
    here = Path(kernels.__file__).parent
    flags = kernels.compile_flags()
    ours = kernels._build_key(flags)
    for p in here.iterdir():
        if p.is_file() and p.suffix != ".py":
            (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(kernels, "_DIR", tmp_path)
    assert kernels._build_key(flags) != ours


def _native_threads() -> set[int]:
    """Ids of this process's OS threads that Python did not start (OpenMP's among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_thread_pool_frees_this_threads_openmp_workers() -> None:
    # Thread ids, not counts: threads that other tests left behind may end meanwhile.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1, 576)
        w = torch.randint(0, 255, (4096, 288), dtype=torch.uint8)
        s, m = torch.rand(4096, 18), torch.rand(4096, 18)
        out = torch.empty(1, 4096)
        kernels.release_thread_pool()
        idle = _native_threads()
        kernels.op("q4_gemm")(x, w, s, m, out)  # a parallel region: its worker stays
        workers = _native_threads() - idle
        assert len(workers) == 1, workers  # 2 threads: this one and one worker
        kernels.release_thread_pool()
        assert not workers & _native_threads()  # that worker is gone
        kernels.op("q4_gemm")(x, w, s, m, out)  # the workers come back when needed
        assert len(_native_threads() - idle - workers) == 1
    finally:
        torch.set_num_threads(before)
