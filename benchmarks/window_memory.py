"""What the window pool buys a model with sliding-window layers (docs/models.md): for one
--kv-cache-memory, the tokens of context the KV pool holds and whether one long prompt is
served, with the window pool and with the one pool (--disable-hybrid-swa-memory), each in a
fresh engine, alternating; greedy tokens compared where both serve it.

    python benchmarks/window_memory.py --model gemma-3-270m-q4_k_m.gguf \\
        --kv-cache-memory 256MiB --prompt-tokens 8000
"""

from __future__ import annotations

import argparse
import random
import time

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.params import SamplingParams
from radixserve.errors import RequestTooLargeError


def serve_once(config: EngineConfig, prompt: list[int], max_tokens: int) -> dict[str, object]:
    """Pool size, and the greedy tokens and seconds of `prompt` (or why it was refused)."""
    engine = LLMEngine(config)
    pool = engine.runner.kv_pool
    row: dict[str, object] = {
        "pool_tokens": engine.kv.pool.num_total * config.block_size,
        "window_slots": pool.window_slots,
    }
    out: dict[str, list[int]] = {}

    def collect(o) -> None:
        if o.finished:
            out["tokens"] = o.token_ids

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        engine.add_request(prompt, params, on_output=collect)
    except RequestTooLargeError as e:
        row["refused"] = str(e)
        return row
    while engine.scheduler.has_work() or engine._inbox:
        engine.step()
    row.update(seconds=time.perf_counter() - t0, tokens=out["tokens"])
    row["preemptions"] = engine.scheduler.num_preemptions
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model with sliding-window layers")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--trials", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(args.prompt_tokens)]
    base = EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory)
    for trial in range(args.trials):
        rows = {}
        for name, off in (("window pool", False), ("one pool", True)):
            config = EngineConfig(**{**base.__dict__, "disable_hybrid_swa_memory": off})
            rows[name] = serve_once(config, prompt, args.max_tokens)
            r = rows[name]
            served = (
                f"refused: {r['refused']}"
                if "refused" in r
                else f"served in {r['seconds']:.2f} s, {r['preemptions']} preemptions"
            )
            print(
                f"trial {trial} {name}: pool {r['pool_tokens']} tokens, window slots "
                f"{r['window_slots']}; {args.prompt_tokens}-token prompt {served}"
            )
        a, b = rows["window pool"].get("tokens"), rows["one pool"].get("tokens")
        if a is not None and b is not None:
            print(f"trial {trial}: greedy tokens {'equal' if a == b else 'DIFFER'}")


if __name__ == "__main__":
    main()
