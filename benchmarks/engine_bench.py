"""The engine with the prefix cache on vs off, side by side in one run (default model).

Run: python benchmarks/engine_bench.py [--dtype bfloat16] [--quick]
Cases: (a) 16 requests sharing a 4,096-token prefix, distinct 64-token suffixes, 32 output
tokens each; (b) an exact repeat of a 2,048-token prompt, and the same plus 50 new tokens;
(c) 8 interleaved chats x 6 turns over a 1,000-token system prompt; (d) decode speed of 1
and 8 concurrent streams; (e) one decode step at 2k context against one read of the weights at
bf16 size; (f) a cold 2,048-token prompt's prefill in GFLOP/s against this machine's matmul
ceiling for the prefill path the model picked (`matmul_ceiling`: torch.mm at the layer's
shapes, bf16 for a bf16 path, int8 for int8-vnni, float32 for fp32), with its share of it;
(g) 8 streams' decode tok/s while a 4,096-token prompt prefills in the same steps, against the
same streams alone. Prints a Markdown table with the on/off ratios, and case (a)'s work: the
GFLOP of its cold prompt and of a hit, whose ratio bounds the hit's gain while both run at one
FLOP rate.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.llm import LLM
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.model import kernels
from radixserve.model.batch import SeqChunk
from radixserve.model.config import ModelConfig
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.runner import StepRow
from radixserve.values import ATTENTION_BACKENDS, KV_CACHE_DTYPES


@functools.cache
def _corpus_ids(llm: LLM) -> list[int]:
    import json
    import pydoc
    import threading
    import typing

    mods = (json, threading, typing)
    return llm.tokenizer.encode(
        "".join(pydoc.render_doc(m, renderer=pydoc.plaintext) for m in mods)
    )


def text_tokens(llm: LLM, n: int, seed: int) -> list[int]:
    """About n tokens of real English text (Python's own docs), varied by seed."""
    ids = _corpus_ids(llm)
    start = (seed * 7919) % max(1, len(ids) - n)
    return ids[start : start + n]


def ttft(out: RequestOutput) -> float:
    m = out.metrics
    assert m.first_token_time is not None
    return m.first_token_time - m.arrival_time


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


SUFFIX = 64  # case (a): each request's own tokens after the shared prefix


def case_shared_prefix(llm: LLM, n_prefix: int, n_req: int) -> dict[str, float]:
    prefix = text_tokens(llm, n_prefix, 1)
    t0 = time.perf_counter()
    first = llm.generate([prefix + text_tokens(llm, SUFFIX, 100)], greedy(32))[0]
    rest = [
        llm.generate([prefix + text_tokens(llm, SUFFIX, 101 + i)], greedy(32))[0]
        for i in range(n_req - 1)
    ]
    total = time.perf_counter() - t0
    return {
        "cold TTFT (s)": ttft(first),
        "hit TTFT p50 (s)": statistics.median(ttft(o) for o in rest),
        "total (s)": total,
    }


def work_line(c: ModelConfig, n_prefix: int, res: dict[str, float]) -> None:
    """Case (a)'s work: the cold prompt's and a hit's GFLOP, the most a hit can gain at equal
    FLOP rates (their ratio), and the rates each ran at (cache on)."""
    cold = prompt_flops(c, n_prefix + SUFFIX, 0) / 1e9
    hit = prompt_flops(c, SUFFIX, n_prefix) / 1e9
    rate_cold, rate_hit = cold / res["cold TTFT (s)"], hit / res["hit TTFT p50 (s)"]
    print(
        f"| (a) work | GFLOP cold vs hit; at equal rates a hit gains | {cold:.1f} vs {hit:.2f} "
        f"| | {cold / hit:.1f}x |\n"
        f"| (a) work | GFLOP/s cold vs hit | {rate_cold:.1f} vs {rate_hit:.1f} | | |",
        flush=True,
    )


def case_repeat(llm: LLM, n: int) -> dict[str, float]:
    prompt = text_tokens(llm, n, 2)
    cold = llm.generate([prompt], greedy(1))[0]
    rep = llm.generate([prompt], greedy(1))[0]
    more = llm.generate([prompt + text_tokens(llm, 50, 3)], greedy(1))[0]
    return {
        "cold TTFT (s)": ttft(cold),
        "exact repeat TTFT (s)": ttft(rep),
        "+50 tokens TTFT (s)": ttft(more),
    }


def case_multi_turn(llm: LLM, convs: int, turns: int, n_system: int) -> dict[str, float]:
    system = llm.tokenizer.decode(text_tokens(llm, n_system, 4))
    histories = [[{"role": "system", "content": system}] for _ in range(convs)]
    ttfts: list[float] = []
    out_tokens = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        for c, h in enumerate(histories):
            h.append(
                {"role": "user", "content": f"Question {turn} of chat {c}: summarise part {turn}."}
            )
            out = llm.chat(h, greedy(24))[0]
            h.append({"role": "assistant", "content": out.text})
            out_tokens += len(out.token_ids)
            if turn > 0:
                ttfts.append(ttft(out))
    total = time.perf_counter() - t0
    return {
        "later-turn TTFT p50 (s)": statistics.median(ttfts),
        "throughput (req/s)": convs * turns / total,
        "output tok/s": out_tokens / total,
    }


def case_decode(llm: LLM, streams: int, n_out: int) -> dict[str, float]:
    prompts = [text_tokens(llm, 256, 10 + i) for i in range(streams)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(n_out))
    total = time.perf_counter() - t0
    first = max(o.metrics.first_token_time for o in outs)  # type: ignore[type-var]
    last = max(o.metrics.finish_time for o in outs)  # type: ignore[type-var]
    decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
    return {f"{streams}-stream decode tok/s": decode_tokens / (last - first), "total (s)": total}


def case_decode_during_prefill(llm: LLM, streams: int, n_out: int, n_long: int) -> dict[str, float]:
    """`streams` decode streams (256-token prompts) sharing their steps with an `n_long`-token
    prompt submitted with them: the engine prefills it in chunks beside their decode rows
    (which stay on the float32 GEMV kernels). Their decode tok/s over the span they decode,
    to compare with case (d)'s same streams alone."""
    prompts = [text_tokens(llm, 256, 10 + i) for i in range(streams)]
    outs = llm.generate([*prompts, text_tokens(llm, n_long, 300)], greedy(n_out))
    short, long_out = outs[:streams], outs[streams]
    first = max(o.metrics.first_token_time for o in short)  # type: ignore[type-var]
    last = max(o.metrics.finish_time for o in short)  # type: ignore[type-var]
    decode_tokens = sum(len(o.token_ids) - 1 for o in short)
    return {
        f"{streams}-stream decode tok/s beside a {n_long}-token prefill": decode_tokens
        / (last - first),
        f"{n_long}-token prompt TTFT (s)": ttft(long_out),
    }


def layer_params(c: ModelConfig) -> int:
    """Weights of one decoder layer's projections."""
    return c.hidden_size * (
        (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, k, v
        + c.num_heads * c.head_dim  # o
        + 3 * c.intermediate_size  # gate, up, down
    )


def prompt_flops(c: ModelConfig, new: int, cached: int) -> float:
    """Multiply-adds x 2 of the work a prompt's first token needs: `new` tokens after `cached`
    ones, every layer's projections and causal attention, with the last layer's attention and
    MLP for the final token only (its K/V for all) and the LM head for that token."""
    kv_proj = c.hidden_size * 2 * c.num_kv_heads * c.head_dim
    pairs = new * cached + new * (new + 1) // 2  # (query, key) pairs over the new tokens
    attn = 4 * c.num_heads * c.head_dim  # scores and weighted values, per pair and layer
    body = (c.num_layers - 1) * (new * layer_params(c) * 2 + pairs * attn)
    last = new * kv_proj * 2 + (layer_params(c) - kv_proj) * 2 + (cached + new) * attn
    return body + last + 2 * c.vocab_size * c.hidden_size


def case_step_vs_weights(llm: LLM, ctx: int = 2048, steps: int = 16) -> dict[str, float]:
    """One stream's decode step at `ctx` tokens of context against one read of the model's
    weights in bf16 (2 bytes per parameter), both timed here (medians)."""
    engine = llm.engine
    c = engine.runner.model.config
    n_params = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    n_params += c.num_layers * layer_params(c)
    # The bytes of bf16 weights, written once: untouched pages would all read the one zero page.
    blob = torch.ones(n_params // 2, dtype=torch.float32)
    reads = []
    for _ in range(7):
        t = time.perf_counter()
        blob.sum()
        reads.append(time.perf_counter() - t)
    n_blocks = (ctx + steps) // engine.block_size + 1
    kv = engine.kv
    table = kv.cache.allocate(n_blocks)
    try:
        ids = text_tokens(llm, ctx, 99)
        engine.runner.run([StepRow(SeqChunk(ids, 0, table))])
        times = []
        for i in range(steps):
            t = time.perf_counter()
            engine.runner.run([StepRow(SeqChunk([ids[i]], ctx + i, table))])
            times.append(time.perf_counter() - t)
    finally:
        kv.pool.free(table)
        # This thread's OpenMP workers would slow the engine loop's steps that follow.
        kernels.release_thread_pool()
    step, read = statistics.median(times), statistics.median(reads)
    return {
        "decode step at 2k (s)": step,
        "bf16 weights read once (s)": read,
        "step / weights read (x)": step / read,
    }


def matmul_ceiling(c: ModelConfig, path: PrefillPath, rows: int, trials: int = 5) -> float:
    """This machine's matmul rate (GFLOP/s) for `path` at the model's shapes: torch.mm of
    `rows` rows through each layer projection's [out, in] (qkv, o, gate_up, down), in bfloat16
    for a bfloat16 path (oneDNN: AMX tiles where the CPU has them), int8 x int8 -> int32 for
    int8-vnni (torch._int_mm) and float32 for fp32 (the FMA units); the best of `trials`
    passes over the four."""
    dtype = {PrefillPath.FP32: torch.float32, PrefillPath.INT8_VNNI: torch.int8}.get(
        path, torch.bfloat16
    )
    mm = torch._int_mm if dtype == torch.int8 else torch.mm
    q_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = [
        (q_rows, c.hidden_size),
        (c.hidden_size, c.num_heads * c.head_dim),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    pairs = [
        (torch.randn(rows, k).mul(30).to(dtype), torch.randn(k, n).mul(30).to(dtype))
        for n, k in shapes
    ]
    flops = sum(2 * rows * n * k for n, k in shapes)
    best = float("inf")
    for _ in range(trials + 1):  # the first pass warms oneDNN's kernel cache
        t = time.perf_counter()
        for x, w in pairs:
            mm(x, w)
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


CEILING_TARGET = 0.60  # issue 30: a 2k prompt's prefill at >= 60% of the path's matmul ceiling


def case_prefill_vs_ceiling(llm: LLM, n: int = 2048, trials: int = 3) -> dict[str, float]:
    """A cold `n`-token prompt's prefill (one runner step, no cache; median of `trials`) in
    GFLOP/s of its work (`prompt_flops`) against `matmul_ceiling` for the path the model
    picked at start-up, measured here in the same run."""
    engine = llm.engine
    c, path = engine.runner.model.config, engine.runner.model.prefill_path
    kv = engine.kv
    table = kv.cache.allocate(n // engine.block_size + 1)
    times = []
    try:
        for i in range(trials):
            ids = text_tokens(llm, n, 200 + i)
            t = time.perf_counter()
            engine.runner.run([StepRow(SeqChunk(ids, 0, table))])
            times.append(time.perf_counter() - t)
        ceiling = matmul_ceiling(c, path, n)
    finally:
        kv.pool.free(table)
        kernels.release_thread_pool()
    rate = prompt_flops(c, n, 0) / statistics.median(times) / 1e9
    return {
        f"prefill {n} tokens (s)": statistics.median(times),
        f"prefill GFLOP/s ({path.value})": rate,
        "matmul ceiling GFLOP/s": ceiling,
        "share of the ceiling": rate / ceiling,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--quantization", default=None, choices=["none", "int8", "int4"])
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = ap.parse_args()
    q = args.quick
    n_prefix = 1024 if q else 4096
    cases: list[tuple[str, Callable[[LLM], dict[str, float]]]] = [
        (
            "(a) shared 4k prefix",
            lambda llm: case_shared_prefix(llm, n_prefix, 4 if q else 16),
        ),
        ("(b) 2k repeat", lambda llm: case_repeat(llm, 512 if q else 2048)),
        (
            "(c) multi-turn chat",
            lambda llm: case_multi_turn(llm, 2 if q else 8, 3 if q else 6, 1000),
        ),
        ("(d) decode x1", lambda llm: case_decode(llm, 1, 16 if q else 64)),
        ("(d) decode x8", lambda llm: case_decode(llm, 8, 16 if q else 64)),
    ]
    llms = {
        on: LLM.from_engine(
            LLMEngine(
                EngineConfig(
                    dtype=args.dtype,
                    kv_cache_memory="1GiB",
                    enable_prefix_cache=on,
                    quantization=args.quantization,
                    attention_backend=args.attention_backend,
                    kv_cache_dtype=args.kv_cache_dtype,
                )
            )
        )
        for on in (True, False)
    }
    e = llms[True].engine
    print(
        f"dtype {e.dtype}, weights {e.quantization}, attention {e.runner.attn.name}, "
        f"KV cache {e.kv_cache_dtype}\n"
    )
    print("| case | metric | cache on | cache off | gain from the cache |")
    print("|---|---|---|---|---|")
    for name, fn in cases:
        res = {on: fn(llms[on]) for on in (False, True)}  # off first: on cannot help off
        for metric in res[True]:
            a, b = res[True][metric], res[False][metric]
            gain = b / a if metric.endswith("(s)") else a / b  # times shrink, rates grow
            print(f"| {name} | {metric} | {a:.3f} | {b:.3f} | {gain:.2f}x |", flush=True)
        if name.startswith("(a)"):
            work_line(e.runner.model.config, n_prefix, res[True])
    for metric, value in case_step_vs_weights(llms[True]).items():
        print(f"| (e) step vs weights | {metric} | {value:.4f} | | |", flush=True)
    alone = case_decode(llms[True], 8, 16 if q else 64)
    mixed = case_decode_during_prefill(llms[True], 8, 16 if q else 64, 1024 if q else 4096)
    rate_alone = next(iter(alone.values()))
    for metric, value in mixed.items():
        print(f"| (g) decode beside a prefill | {metric} | {value:.3f} | | |", flush=True)
    rate_mixed = next(iter(mixed.values()))
    print(
        f"| (g) decode beside a prefill | 8-stream decode tok/s alone; beside / alone | "
        f"{rate_alone:.3f} | | {rate_mixed / rate_alone:.2f}x |",
        flush=True,
    )
    res = case_prefill_vs_ceiling(llms[True], 512 if q else 2048)
    for metric, value in res.items():
        print(f"| (f) prefill vs ceiling | {metric} | {value:.3f} | | |", flush=True)
    share = res["share of the ceiling"]
    verdict = "meets" if share >= CEILING_TARGET else "is below"
    print(
        f"\nprefill at {share:.0%} of this machine's matmul ceiling for its path "
        f"({verdict} the {CEILING_TARGET:.0%} target)",
        flush=True,
    )
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
