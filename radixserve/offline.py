"""`radixserve generate` and `radixserve chat`: one answer from the command line."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from radixserve.engine.config import EngineConfig
from radixserve.options import add_options, from_args, option, types


@dataclass(frozen=True)
class GenerateConfig:
    """How `generate` and `chat` sample their one answer, and what they print."""

    max_tokens: int = option(128, "tokens to generate at most", type=types.positive_int)
    temperature: float = option(0.0, "sampling temperature (0: greedy)", type=types.number)
    top_p: float = option(
        1.0, "nucleus sampling: keep the top tokens up to this mass", type=types.number
    )
    top_k: int = option(-1, "keep only the k likeliest tokens (-1: all)", type=types.whole_number)
    seed: int | None = option(
        None, "seed of the draw (with temperature > 0)", type=types.whole_number
    )
    stop: list[str] = option([], "stop string (repeatable)", repeat=True)
    stats: bool = option(False, "print timing to stderr")
    system: str | None = option(None, "an optional system prompt", commands=("chat",))


def _add_common(p: argparse.ArgumentParser, command: str) -> None:
    add_options(p, EngineConfig, command)
    add_options(p, GenerateConfig, command)


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """Arguments of `radixserve generate PROMPT`."""
    p.add_argument("prompt", help="raw text to complete")
    _add_common(p, "generate")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """Arguments of `radixserve chat MESSAGE`."""
    p.add_argument("message", help="the user's message")
    _add_common(p, "chat")


def _run(args: argparse.Namespace, chat: bool) -> int:
    from radixserve.engine.engine import LLMEngine
    from radixserve.engine.llm import LLM
    from radixserve.engine.params import SamplingParams
    from radixserve.errors import RadixServeError

    try:
        gen = from_args(GenerateConfig, args)
        params = SamplingParams(
            max_tokens=gen.max_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            seed=gen.seed,
            stop=gen.stop,
        )
        t0 = time.perf_counter()
        with LLM.from_engine(LLMEngine(from_args(EngineConfig, args))) as llm:
            t1 = time.perf_counter()
            if chat:
                messages = [{"role": "user", "content": args.message}]
                if gen.system:
                    messages.insert(0, {"role": "system", "content": gen.system})
                out = llm.chat(messages, params)[0]
            else:
                out = llm.generate([args.prompt], params)[0]
            t2 = time.perf_counter()
    except (RadixServeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    if gen.stats:
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
