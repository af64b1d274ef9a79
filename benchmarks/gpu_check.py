"""One-shot GPU check of radixserve: exactness against transformers, TTFT, decode speed with
and without CUDA graphs, and transformers' own `generate` as the baseline; one Markdown table.

Without `--model`, both radixserve and transformers get the default model's architecture
(SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head_dim 64, vocab 49152) with the same seeded
random weights, and its position limit is raised from 8,192 to 33,792 (RoPE tables) in both so
the 32k-token row fits; the table's title says so. `--model DIR_OR_GGUF` uses real weights
(a GGUF is converted first, which needs the `gguf` package).

On an H200 through the `device` tool (under 8 minutes; everything it imports is on that
machine: torch, triton, transformers, tokenizers, numpy, safetensors, tqdm; no server
packages and no wheels to carry):

    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/gpu_check.md",
        timeout_s=540)

Here, on CPU, a smoke run with tiny sizes: `python benchmarks/gpu_check.py --device cpu --quick`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/gpu_check.py` from anywhere
    sys.path.insert(0, str(ROOT))

from radixserve.engine.config import EngineConfig  # noqa: E402
from radixserve.engine.engine import LLMEngine  # noqa: E402
from radixserve.engine.llm import LLM  # noqa: E402
from radixserve.engine.outputs import RequestOutput  # noqa: E402
from radixserve.engine.params import SamplingParams  # noqa: E402
from radixserve.engine.tokenizer import Tokenizer  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402
from radixserve.model.decoder import DecoderModel  # noqa: E402
from radixserve.model.weights import load_hf_weights  # noqa: E402
from radixserve.values import ATTENTION_BACKENDS  # noqa: E402

# SmolLM2-135M-Instruct's config.json (the default model), as transformers reads it.
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
# --quick: a two-layer model of the same kind, small enough for a CPU smoke run.
TINY: dict[str, Any] = SMOLLM2_135M | dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


@dataclass
class Sizes:
    """What the checks run: prompt lengths, streams, tokens."""

    cold: tuple[int, ...] = (2048, 8192, 32768)
    hit_cached: int = 8192
    hit_new: int = 50
    streams: tuple[int, ...] = (1, 8, 64)
    decode_prompt: int = 128
    decode_tokens: int = 256
    logits_prompt: int = 256
    logits_steps: int = 16
    onoff_prefix: int = 1024
    onoff_requests: int = 8
    onoff_tokens: int = 32
    repeats: int = 3
    max_num_batched_tokens: int = 8192
    kv_cache_memory: str = "16GiB"

    @property
    def max_len(self) -> int:
        """Context the engines and models allow: the longest prompt plus room to answer."""
        return max(*self.cold, self.hit_cached + self.hit_new) + 1024


QUICK = Sizes(
    cold=(64, 128, 256), hit_cached=128, hit_new=8, streams=(1, 2, 4), decode_prompt=16,
    decode_tokens=16, logits_prompt=32, logits_steps=4, onoff_prefix=48, onoff_requests=3,
    onoff_tokens=8, repeats=1, max_num_batched_tokens=256, kv_cache_memory="64MiB",
)  # fmt: skip


@dataclass
class Row:
    """One line of the table."""

    check: str
    result: str
    target: str = ""
    met: bool | None = None


def greedy(n: int, logits: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, return_logits=logits)


def ttft(out: RequestOutput) -> float:
    m = out.metrics
    assert m.first_token_time is not None
    return m.first_token_time - m.arrival_time


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()  # clear of bos/eos/unk


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer whose tokens are the words t0..tN (random weights have no text)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    return Tokenizer(hf)


class Models:
    """The model under test in radixserve and in transformers, same weights, any dtype."""

    def __init__(self, model: str | None, quick: bool, max_len: int, device: torch.device):
        self.device = device
        if model is None:
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = (TINY if quick else SMOLLM2_135M) | {"max_position_embeddings": max_len}
            torch.manual_seed(0)
            self.hf_config = LlamaConfig(**cfg)
            self.hf_fp32 = LlamaForCausalLM(self.hf_config).eval()
            self.state = self.hf_fp32.state_dict()
            self.config = ModelConfig.from_hf_dict(cfg | {"architectures": ["LlamaForCausalLM"]})
            self.tokenizer = word_tokenizer(self.config.vocab_size)
            base = "tiny random Llama" if quick else "random weights, SmolLM2-135M shape"
            self.title = f"{base}, positions raised to {max_len:,} in both"
            return
        from transformers import LlamaForCausalLM

        from radixserve.model.files import hf_export_dir, resolve_model
        from radixserve.model.loader import load_state_dict

        files = resolve_model(model)
        hf_dir = hf_export_dir(files)
        config = ModelConfig.from_dir(files.path)
        extend = max(config.max_position_embeddings, max_len)
        self.config = dataclasses.replace(config, max_position_embeddings=extend)
        self.hf_fp32 = LlamaForCausalLM.from_pretrained(
            hf_dir, max_position_embeddings=extend, dtype=torch.float32
        ).eval()
        self.state = load_state_dict(hf_dir, torch.float32)
        self.tokenizer = Tokenizer.from_dir(files.path)
        raised = f", positions raised to {extend:,} in both" if extend > 8192 else ""
        self.title = f"{files.name}{raised}"

    def ours(self, dtype: torch.dtype) -> DecoderModel:
        model = DecoderModel(self.config, dtype)
        load_hf_weights(model, self.state)
        model = model.to(self.device).eval()
        model.prepare()
        return model

    def hf(self, dtype: torch.dtype) -> Any:
        return copy.deepcopy(self.hf_fp32).to(self.device, dtype).eval()


def engine(models: Models, model: DecoderModel, sizes: Sizes, **kw: Any) -> LLM:
    config = EngineConfig(
        kv_cache_memory=sizes.kv_cache_memory,
        max_model_len=sizes.max_len,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        max_num_seqs=max(64, *sizes.streams),
        **kw,
    )
    return LLM.from_engine(LLMEngine.from_parts(config, model, models.tokenizer, "gpu-check"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(*llms: LLM) -> None:
    for llm in llms:
        llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_logits(models: Models, dtype: torch.dtype, sizes: Sizes, backend: str) -> Row:
    """Our logits along a greedy continuation against transformers' over the same tokens."""
    llm = engine(models, models.ours(dtype), sizes, attention_backend=backend)
    prompt = random_ids(sizes.logits_prompt, models.config.vocab_size, 1)
    out = llm.generate([prompt], greedy(sizes.logits_steps, logits=True))[0]
    name = llm.engine.runner.attn.name
    release(llm)
    hf = models.hf(dtype)
    ids = torch.tensor([prompt + out.token_ids[:-1]], device=models.device)
    with torch.inference_mode():
        ref = hf(ids).logits[0, len(prompt) - 1 :].float().cpu()
    del hf
    ours = torch.stack([row.float().cpu() for row in out.logits])
    diff = (ours - ref).abs().max().item()
    same = int((ours.argmax(-1) == ref.argmax(-1)).sum())
    kind = str(dtype).removeprefix("torch.")
    return Row(
        f"logits vs transformers, {kind} ({name} attention, {len(ours)} positions)",
        f"max abs diff {diff:.2e}; argmax equal {same}/{len(ours)}",
    )


def check_on_off(models: Models, dtype: torch.dtype, sizes: Sizes, backend: str) -> Row:
    """Greedy tokens with the prefix cache on and off: shared prefix, first request alone so
    the rest hit its cached blocks."""
    v = models.config.vocab_size
    prefix = random_ids(sizes.onoff_prefix, v, 2)
    prompts = [prefix + random_ids(16, v, 100 + i) for i in range(sizes.onoff_requests)]
    tokens, cached = {}, 0
    for on in (True, False):
        llm = engine(
            models, models.ours(dtype), sizes, enable_prefix_cache=on, attention_backend=backend
        )
        outs = llm.generate(prompts[:1], greedy(sizes.onoff_tokens))
        outs += llm.generate(prompts[1:], greedy(sizes.onoff_tokens))
        tokens[on] = [o.token_ids for o in outs]
        if on:
            cached = sum(o.num_cached_tokens for o in outs)
        release(llm)
    equal = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
    n = len(prompts)
    kind = str(dtype).removeprefix("torch.")
    return Row(
        f"greedy cache on == off, {kind} ({n} requests x {sizes.onoff_tokens} tokens)",
        f"{equal}/{n} equal; {cached:,} prompt tokens from the cache",
        "all equal",
        equal == n,
    )


def check_ttft(llm: LLM, models: Models, sizes: Sizes) -> list[Row]:
    """Cold prompts of each length (medians of fresh prompts after a warm-up one), then a
    cached prefix plus new tokens."""
    v, rows, seed = models.config.vocab_size, [], 1000
    for n in sizes.cold:
        llm.generate([random_ids(n, v, seed)], greedy(1))  # warm-up: kernels for this size
        times = []
        for _ in range(sizes.repeats):
            seed += 1
            times.append(ttft(llm.generate([random_ids(n, v, seed)], greedy(1))[0]))
        ms = statistics.median(times) * 1e3
        target, met = ("<= 80 ms", ms <= 80) if n == 8192 else ("", None)
        rows.append(Row(f"cold TTFT, {n:,}-token prompt", f"{ms:.1f} ms", target, met))
    times = []
    for _ in range(sizes.repeats + 1):  # the first pair warms up
        seed += 1
        prefix = random_ids(sizes.hit_cached, v, seed)
        llm.generate([prefix], greedy(1))
        out = llm.generate([prefix + random_ids(sizes.hit_new, v, seed + 10**6)], greedy(1))[0]
        assert out.num_cached_tokens >= sizes.hit_cached - llm.engine.block_size
        times.append(ttft(out))
    ms = statistics.median(times[1:]) * 1e3
    label = f"hit TTFT, {sizes.hit_cached:,} cached + {sizes.hit_new} new tokens"
    return [*rows, Row(label, f"{ms:.1f} ms", "<= 15 ms", ms <= 15)]


def decode_rate(llm: LLM, models: Models, streams: int, sizes: Sizes) -> float:
    """Aggregate decode tok/s of `streams` concurrent greedy requests (first tokens excluded)."""
    v = models.config.vocab_size
    prompts = [random_ids(sizes.decode_prompt, v, 5000 + i) for i in range(streams)]
    llm.generate(prompts, greedy(4))  # warm-up at this batch size
    outs = llm.generate(prompts, greedy(sizes.decode_tokens))
    first = max(o.metrics.first_token_time or 0.0 for o in outs)
    last = max(o.metrics.finish_time or 0.0 for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (last - first)


def hf_generate_rate(models: Models, dtype: torch.dtype, sizes: Sizes) -> float:
    """transformers' `generate`, one stream, greedy: new tokens per second (prefill included,
    which a short prompt keeps small)."""
    hf = models.hf(dtype)
    ids = torch.tensor([random_ids(sizes.decode_prompt, models.config.vocab_size, 5000)])
    ids = ids.to(models.device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        sync(models.device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        sync(models.device)
        assert out.shape[1] == ids.shape[1] + n
        return n / (time.perf_counter() - t)

    gen(8)  # warm-up
    return gen(sizes.decode_tokens)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: random)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the served dtype (bfloat16)")
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    args = ap.parse_args(argv)
    from radixserve.model.loader import resolve_device

    device = resolve_device(args.device)
    sizes = QUICK if args.quick else Sizes()
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    models = Models(args.model, args.quick, sizes.max_len, device)
    be = args.attention_backend
    rows = [
        check_logits(models, torch.float32, sizes, be),
        check_logits(models, dtype, sizes, be),
        check_on_off(models, torch.float32, sizes, be),
        check_on_off(models, dtype, sizes, be),
    ]
    graphs = engine(models, models.ours(dtype), sizes, attention_backend=be)
    rows += check_ttft(graphs, models, sizes)
    rates: dict[tuple[bool, int], float] = {}
    for n in sizes.streams:
        rates[False, n] = decode_rate(graphs, models, n, sizes)
    release(graphs)
    eager = engine(models, models.ours(dtype), sizes, attention_backend=be, enforce_eager=True)
    for n in sizes.streams:
        rates[True, n] = decode_rate(eager, models, n, sizes)
    release(eager)
    hf_rate = hf_generate_rate(models, dtype, sizes)
    graphs_name = "CUDA graphs" if device.type == "cuda" else "compiled"
    for n in sizes.streams:
        rows.append(
            Row(
                f"decode tok/s, {n} stream{'s' if n > 1 else ''} ({graphs_name} / eager)",
                f"{rates[False, n]:,.0f} / {rates[True, n]:,.0f}",
            )
        )
    rows.append(Row("transformers `generate` tok/s, 1 stream", f"{hf_rate:,.0f}"))
    ratio = rates[False, sizes.streams[0]] / hf_rate
    rows.append(Row("decode 1 stream / transformers", f"{ratio:.1f}x", ">= 5x", ratio >= 5))
    if args.quick:  # the targets are for the full sizes; only on == off holds at any size
        for r in rows:
            if not r.check.startswith("greedy cache"):
                r.target, r.met = "", None
    print_table(rows, models, device, dtype, args, time.perf_counter() - t_start)
    return rows


def print_table(
    rows: list[Row],
    models: Models,
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
    seconds: float,
) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    day = datetime.date.today().isoformat()
    kind = str(dtype).removeprefix("torch.")
    quick = ", --quick sizes (targets are for the full run)" if args.quick else ""
    print(f"\n### radixserve gpu_check: {name}, {day}, {models.title}{quick}\n")
    print(
        f"{kind} unless a row says otherwise; --attention-backend {args.attention_backend}; "
        f"torch {torch.__version__}; {seconds:.0f} s in all.\n"
    )
    print("| check | result | target | met |")
    print("|---|---|---|---|")
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "NO")
        print(f"| {r.check} | {r.result} | {r.target} | {met} |")


if __name__ == "__main__":
    main()
