"""`radixserve generate` and `radixserve chat`: one answer from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from radixserve import options


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", type=options.device, default="auto", help="auto | cpu | cuda")
    p.add_argument("--kv-cache-memory", type=options.memory_size, default="256MiB")
    p.add_argument("--quantization", "-q", default=None, choices=["none", "int8", "int4"])
    p.add_argument("--attention-backend", default="auto", choices=options.ATTENTION_BACKENDS)
    p.add_argument(
        "--kv-cache-dtype",
        type=options.kv_cache_dtype,
        default="auto",
        help="K/V storage: auto (the model dtype), float32, bfloat16, float16",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for decode steps (CPU steps always run eagerly)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print timing to stderr")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """Arguments of `radixserve generate PROMPT`."""
    p.add_argument("prompt", help="raw text to complete")
    _add_common(p)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """Arguments of `radixserve chat MESSAGE`."""
    p.add_argument("message", help="the user's message")
    p.add_argument("--system", default=None, help="an optional system prompt")
    _add_common(p)


def _run(args: argparse.Namespace, chat: bool) -> int:
    from radixserve.engine.llm import LLM
    from radixserve.engine.params import SamplingParams
    from radixserve.errors import RadixServeError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
        t0 = time.perf_counter()
        with LLM(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            kv_cache_memory=args.kv_cache_memory,
            quantization=args.quantization,
            attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager,
        ) as llm:
            t1 = time.perf_counter()
            if chat:
                messages = [{"role": "user", "content": args.message}]
                if args.system:
                    messages.insert(0, {"role": "system", "content": args.system})
                out = llm.chat(messages, params)[0]
            else:
                out = llm.generate([args.prompt], params)[0]
            t2 = time.perf_counter()
    except (RadixServeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    if args.stats:
        print(
            f"[load {t1 - t0:.1f}s, {len(out.prompt_token_ids)} prompt + "
            f"{len(out.token_ids)} output tokens in {t2 - t1:.2f}s, {out.finish_reason}; "
            f"{llm.engine.dtype} on {llm.engine.device}, weights {llm.engine.quantization}]",
            file=sys.stderr,
        )
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Complete a raw prompt and print the text."""
    return _run(args, chat=False)


def run_chat(args: argparse.Namespace) -> int:
    """Answer one chat message through the model's chat template and print it."""
    return _run(args, chat=True)
