"""What structured outputs and n > 1 cost, on the default model (the API issue's figures).

Run: python benchmarks/structured_bench.py [--trials 20]

(a) Grammar engines, per token: llguidance (what radixserve runs, through its own
    `GrammarCompiler`) and xgrammar when it is installed (it is not a dependency: `pip
    install --no-deps xgrammar apache-tvm-ffi` to compare). For the agent workload's five tool
    schemas as one JSON schema (one call of any tool, json.dumps separators): compile time, and
    the time to fill one next-token bitmask and accept one token, over valid calls' tokens.
(b) Constrained vs free decoding in the engine: the same chat prompts (the agent workload's
    system prompt and tools, tool_choice "required", i.e. the call grammar radixserve builds),
    4 at a time, their prompts cached first. Decoded constrained, then freely for exactly as
    many tokens each (ignore_eos), alternately `--trials` times: time per output token
    ((finish - first token) / (tokens - 1), median over requests and trials) on both sides.
(c) `n=8` against 8 identical requests sent at once: prompt tokens computed (prefill work)
    and TTFT, prompts new to the cache each time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from radixserve.bench.tools import AGENT_TOOLS
from radixserve.engine.llm import LLM
from radixserve.engine.params import SamplingParams
from radixserve.engine.structured import JSON_STYLE, StructuredOutput
from radixserve.engine.tool_calls import call_grammar, function_of, parameters_of

CALLS = [
    ("read_file", {"path": "radixserve/cache/trie.py"}),
    ("grep", {"pattern": "def insert", "path": "radixserve/cache", "max_matches": 20}),
    ("read_file", {"path": "tests/cache/test_trie.py"}),
    ("grep", {"pattern": "evict", "path": "radixserve", "max_matches": 5}),
]
TASKS = [
    "Find where the radix tree splits a node and explain the invariant it keeps.",
    "Why does the scheduler admit waiting requests in cache-aware order? Check the code.",
    "List the tests that cover eviction under memory pressure.",
    "Locate the function that publishes KV events and read it.",
]


def calls_schema() -> dict[str, Any]:
    """One call of any agent tool, as a JSON schema (the body of radixserve's call grammar)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": function_of(t)["name"]},
                    "arguments": parameters_of(t),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in AGENT_TOOLS
        ]
    }


def _us(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:.1f} us (p90 {sorted(xs)[int(0.9 * len(xs))] * 1e6:.1f})"


def _time_tokens(
    outputs: list[list[int]],
    repeats: int,
    start: Callable[[], Any],
    step: Callable[[Any, int], bool],
) -> list[float]:
    """Seconds of each `step(matcher, token)` (fill the next bitmask, accept the token) over
    every output, `repeats` times, a fresh `start()` matcher per output."""
    times: list[float] = []
    for _ in range(repeats):
        for out in outputs:
            m = start()
            for t in out:
                a = time.perf_counter()
                ok = step(m, t)
                times.append(time.perf_counter() - a)
                assert ok, "a grammar engine refused a valid call"
    return times


def case_engines(llm: LLM, repeats: int = 50) -> None:
    """(a): compile time and per-token mask + accept time, llguidance and (if present) xgrammar."""
    tok = llm.engine.tokenizer
    schema = calls_schema()
    outputs = [tok.encode(json.dumps({"name": n, "arguments": a})) for n, a in CALLS]
    n_tokens = sum(len(o) for o in outputs)
    print(f"(a) one call of 5 tools as a JSON schema; {len(outputs)} calls, {n_tokens} tokens")

    import torch

    grammars = llm.engine.grammars
    grammars._tokenizer()  # llguidance's view of the vocabulary, built once (as TokenizerInfo)
    t0 = time.perf_counter()
    compiled = grammars._build(StructuredOutput.json_schema(schema))  # uncached: timed
    compile_s = time.perf_counter() - t0
    row = torch.zeros(grammars.bitmask_words, dtype=torch.int32)

    def ll_step(m: Any, t: int) -> bool:
        m.fill_bitmask(row)
        return bool(m.accept(t))

    per_token = _time_tokens(outputs, repeats, compiled.matcher, ll_step)
    print(f"| llguidance (radixserve) | compile {compile_s * 1e3:.0f} ms | mask + accept per "
          f"token {_us(per_token)} |")  # fmt: skip
    try:
        import xgrammar as xgr
    except ImportError:
        print("| xgrammar | not installed | |")
        return
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=grammars.vocab_size)
    t0 = time.perf_counter()
    xc = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(schema),
        any_whitespace=JSON_STYLE["whitespace_flexible"],
        separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]),
    )
    compile_x = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, grammars.vocab_size)

    def xg_step(m: Any, t: int) -> bool:
        m.fill_next_token_bitmask(mask)
        return bool(m.accept_token(t))

    per_token_x = _time_tokens(outputs, repeats, lambda: xgr.GrammarMatcher(xc), xg_step)
    print(f"| xgrammar {getattr(xgr, '__version__', '')} | compile {compile_x * 1e3:.0f} ms | "
          f"mask + accept per token {_us(per_token_x)} |")  # fmt: skip


def _tpot(outs: list[Any]) -> list[float]:
    return [
        (o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
        for o in outs
        if len(o.token_ids) > 1
    ]


def case_constrained_vs_free(llm: LLM, trials: int) -> None:
    """(b): the same prompts decoded under the call grammar, then freely to the same lengths."""
    tok = llm.engine.tokenizer
    system = "You are a coding agent working in a Python project. Call one tool per turn."
    prompts = [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": task}],
            tools=AGENT_TOOLS,
        )
        for task in TASKS
    ]
    grammar = StructuredOutput("grammar", call_grammar(AGENT_TOOLS, False), "tool_choice", True)
    constrained = SamplingParams(max_tokens=64, temperature=0.0, structured=grammar)
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))  # prompts cached
    on: list[float] = []
    off: list[float] = []
    for _ in range(trials):
        outs = llm.generate(prompts, constrained)
        lengths = [len(o.token_ids) for o in outs]
        on += _tpot(outs)
        free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        outs_free = llm.generate(prompts, free)
        assert [len(o.token_ids) for o in outs_free] == lengths
        off += _tpot(outs_free)
    a, b = statistics.median(on), statistics.median(off)
    print(f"\n(b) {len(prompts)} prompts at once, {trials} trials, output lengths {lengths}")
    print(f"| constrained (call grammar) | TPOT p50 {a * 1e3:.2f} ms |")
    print(f"| free, same lengths | TPOT p50 {b * 1e3:.2f} ms |")
    print(f"| constrained / free | {a / b:.3f}x ({a / b - 1:+.1%} per output token) |")


def case_n(llm: LLM, trials: int, n: int = 8, prompt_tokens: int = 1024) -> None:
    """(c): one request with n choices against n identical requests sent together."""
    words = ("cache tree block pool scheduler prefix decode token engine router " * 200).split()
    rows: dict[str, list[tuple[int, float]]] = {"n=8": [], "8 requests": []}
    for trial in range(trials):
        for label in rows:
            # A prompt new to the cache each time: a different leading number.
            text = f"{trial}-{label}: " + " ".join(words)
            ids = llm.engine.tokenizer.encode(text)[:prompt_tokens]
            t0 = time.monotonic()
            sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1)
            if label == "n=8":
                outs = llm.generate([ids], dataclasses.replace(sp, n=n))
            else:
                outs = llm.generate([ids] * n, sp)
            ttft = statistics.median(o.metrics.first_token_time - t0 for o in outs)
            assert len(outs) == n
            computed = sum(o.metrics.num_computed_prompt_tokens for o in outs)
            rows[label].append((computed, ttft))
    print(f"\n(c) a {prompt_tokens}-token prompt, {n} samples of 16 tokens, {trials} trials")
    for label, vals in rows.items():
        computed = statistics.median(v[0] for v in vals)
        ttft = statistics.median(v[1] for v in vals)
        print(f"| {label} | prompt tokens computed {computed:.0f} | TTFT p50 {ttft * 1e3:.0f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory="1GiB")
    try:
        case_engines(llm)
        case_constrained_vs_free(llm, args.trials)
        case_n(llm, args.trials)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
