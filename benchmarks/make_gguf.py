"""Write a random-weight Llama GGUF at a real model's shape, for measuring models at size.

    python benchmarks/make_gguf.py 1b /tmp/llama-1b-f16.gguf
    python benchmarks/make_gguf.py 8b /tmp/llama-8b-f16.gguf \
        --quantize Q4_K_M --llama-quantize ~/llama.cpp/build/bin/llama-quantize

The body is the named model's (Llama 3.2 1B / 3B, Llama 3.1 8B: hidden size, layers, heads,
FFN), the vocabulary and chat template SmolLM2's (copied from the default model's GGUF), the
weights normal(0, 0.02) and the norms 1, written as float16 tensor by tensor (an 8B never sits
in memory whole). `--quantize` then runs llama.cpp's `llama-quantize` (built as
docs/performance.md says) into the type named, beside the F16 file. Speed does not depend on
the weights' values; greedy text from random weights means nothing.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np

# name: (hidden, layers, heads, kv heads, FFN, tied embeddings)
SHAPES = {
    "1b": (2048, 16, 32, 8, 8192, True),
    "3b": (3072, 28, 24, 8, 8192, True),
    "8b": (4096, 32, 32, 8, 14336, False),
}


def tensors(shape: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor, in llama.cpp's order."""
    hidden, layers, heads, kv_heads, ffn, tied = SHAPES[shape]
    head_dim = hidden // heads
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (hidden,)),
            (b + "attn_q.weight", (heads * head_dim, hidden)),
            (b + "attn_k.weight", (kv_heads * head_dim, hidden)),
            (b + "attn_v.weight", (kv_heads * head_dim, hidden)),
            (b + "attn_output.weight", (hidden, heads * head_dim)),
            (b + "ffn_norm.weight", (hidden,)),
            (b + "ffn_gate.weight", (ffn, hidden)),
            (b + "ffn_up.weight", (ffn, hidden)),
            (b + "ffn_down.weight", (hidden, ffn)),
        ]
    out.append(("output_norm.weight", (hidden,)))
    if not tied:
        out.append(("output.weight", (vocab, hidden)))
    return out


def write(shape: str, path: Path, source: Path, seed: int = 0) -> None:
    """Write the F16 GGUF of `shape` at `path`, with `source`'s tokenizer fields."""
    import gguf

    hidden, layers, heads, kv_heads, ffn, _ = SHAPES[shape]
    reader = gguf.GGUFReader(str(source))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random llama {shape}")
    w.add_context_length(131072)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub)
    specs = tensors(shape, vocab)
    for name, dims in specs:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    # A pool of normal(0, 0.02) values read from a random start per tensor: drawing 8 billion
    # fresh ones would take minutes, and speed does not depend on the values.
    pool = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).astype(np.float16)
    for name, dims in specs:
        if len(dims) == 1:
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        n = int(np.prod(dims))
        start = int(rng.integers(0, pool.size))
        values = np.resize(np.roll(pool, -start), n).reshape(dims)
        w.write_tensor_data(values)
        print(f"{name} {dims}", flush=True)
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path, help="the F16 GGUF to write")
    p.add_argument("--quantize", help="a llama-quantize type, e.g. Q4_K_M")
    p.add_argument("--llama-quantize", type=Path, help="the llama-quantize binary")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from radixserve.model.files import default_gguf

    write(args.shape, args.out, default_gguf())
    if args.quantize:
        if args.llama_quantize is None:
            p.error("--quantize needs --llama-quantize")
        out = args.out.with_name(f"{args.out.stem.removesuffix('-f16')}-{args.quantize}.gguf")
        cmd = [str(args.llama_quantize), str(args.out), str(out), args.quantize, str(args.threads)]
        subprocess.run(cmd, check=True)
        print(out)


if __name__ == "__main__":
    main()
