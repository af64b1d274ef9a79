"""Decode speed of the Qwen family against the Llama path at equal parameter count, one run.

Run: python benchmarks/arch_decode_bench.py [--quantization int4] [--trials 5]

Random Hugging Face checkpoints (nothing from a hub) of Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k
norms), all of the default model's shapes (SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV
heads, intermediate 1536, vocabulary 49152), written as model directories and loaded as
`radixserve serve --model DIR` loads them (float32 on the CPU, `--quantization`). Single-stream
decode tokens/s over a 256-token context, the architectures interleaved trial by trial; prints a
Markdown table with each one's ratio to Llama.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixserve.model.batch import SeqChunk
from radixserve.model.files import ModelFiles
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, StepRow

SHAPES: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
ARCHS = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
}


def write_checkpoint(root: Path, name: str) -> ModelFiles:
    """A random checkpoint of architecture `name` at SHAPES, saved under `root`."""
    import transformers

    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SHAPES, **extra)
    model = getattr(transformers, model_cls)(config)
    out = root / name
    model.save_pretrained(out)
    return ModelFiles(out, name)


def decode_rate(runner: ModelRunner, steps: int, context: int = 256) -> float:
    """Tokens/s of `steps` single-sequence decode steps after a `context`-token prefill."""
    table = list(range((context + steps) // 16 + 2))
    runner.run([StepRow(SeqChunk([(7 * i) % 40000 + 100 for i in range(context)], 0, table))])
    t0 = time.perf_counter()
    for i in range(steps):
        runner.run([StepRow(SeqChunk([(11 * i) % 40000 + 100], context + i, table))])
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHS:
            files = write_checkpoint(Path(tmp), name)
            model = load_model(files, torch.float32, torch.device("cpu"), args.quantization)
            params = model.config.num_parameters()
            print(f"{name}: {params / 1e6:.2f}M weights, {model.quantization}", flush=True)
            runners[name] = ModelRunner(model, 64, 16)
        rates: dict[str, list[float]] = {name: [] for name in ARCHS}
        for _ in range(args.trials):
            for name, runner in runners.items():
                rates[name].append(decode_rate(runner, args.steps))
    base = statistics.median(rates["Llama"])
    print("\n| architecture | decode 1 stream (tok/s, median) | / Llama |")
    print("|---|---|---|")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
