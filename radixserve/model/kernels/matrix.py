"""The arithmetic a quantized float32 model's prefill runs in, picked once at start-up by what
the CPU has. Each path's measured speed and quality: docs/cpu.md.

- `amx-bf16`: on CPUs with AMX (Intel Sapphire Rapids and later), prefill chunks' matmuls
  run on the tile units from int4/int8 codes dequantized into bfloat16 panels (gemm_bf16.cpp),
  and prefill attention multiplies bfloat16 Q, K, V and probabilities on the tiles
  (attention_bf16.cpp); sums are float32 throughout. Linux must grant the process AMX's tile
  state (arch_prctl): where it refuses, this path is not offered.
- `avx512-bf16`: the same GEMM panels and attention through AVX-512 BF16's vdpbf16ps. Not
  picked by itself (one vdpbf16ps a cycle lost to two float32 FMAs on the AMX Xeon);
  selectable for CPUs where it may pay.
- `int8-vnni`: on CPUs with AVX-512 VNNI but no AMX (Cascade Lake, Ice Lake, Zen 4), each
  row is quantized to int8 per group of 32 (scale max|x| / 127, as llama.cpp's Q8
  activations) and meets the int4/int8 codes in vpdpbusd integer dot products
  (gemm_vnni.cpp); sums of groups float32. Attention is bf16 through vdpbf16ps on CPUs with
  AVX-512 BF16 and no AMX in hardware, float32 elsewhere (where a CPU has AMX its two
  float32 FMAs a cycle match one vdpbf16ps).
- `int8-avx2`: on CPUs with AVX2 but neither AMX nor AVX-512 VNNI (AMD Zen 2/3, older
  Intel), a GGUF's Q4_K matrices are held as int8-vnni's int4-vnni panels with the blocks'
  own factors (4.75 bits a weight), on which every row, decode or prefill, meets int8
  activations through vpmaddubsw (gemm_panels_avx2.cpp: the same arithmetic per output as
  vpdpbusd's, so a row's bits do not depend on what shares its step). Other K-quant blocks
  (Q5_K, Q6_K, a mixed qkv) are kept as the file stores them: their decode rows and chunks
  shorter than 8 rows meet int8 activations per group of 32 through vpmaddubsw (gguf_q8.cpp),
  longer chunks run the float32 kernels over the same blocks. Matrices wholly of Q4_0 / Q4_1
  / Q5_0 / Q8_0 are repacked into int4 / int8 codes and run the float32 kernels as on fp32
  (faster there than int8 activations on such blocks); attention is float32.
- `fp32`: float32 everywhere (radixserve's float32 kernels, exact to float32 rounding): the
  choice on CPUs without AVX2 and for `--dtype float32`.

Decode rows (1-16 a step, or the decode rows of a mixed step, and chunks shorter than
`min_rows`) take int8 activations on every path but fp32 (`int8_decode`; on the bfloat16 paths
where the CPU has AVX-512 VNNI, as every CPU with AVX-512 BF16 so far does): int4 matrices are
held as panels (QuantizedWeight kind int4-vnni, in place of the codes; gemm_vnni.cpp), int8
codes are read as stored (gemm_vnni.cpp's decode rows), and GGUF blocks of other kinds (Q6_K,
Q5_K, mixed) as stored (gguf_q8.cpp, as on int8-avx2). A decode row streams its weights from
memory once a token, and int8 activations meet 4 codes an instruction where float32 turns each
code into a float first: on a model larger than the L3 cache this is what decode speed is
(docs/cpu.md). On int8-vnni every row of an int4 matrix, decode or prefill, runs on its panels
in one call, so a row's result never depends on what shares its step; on the bfloat16 paths
the matrix units read long chunks from the same panels (gemm_bf16.cpp), and decode rows give
the same bits whatever shares their step too. Without VNNI, decode rows on the bfloat16 paths
run the float32 GEMV kernels (GGUF blocks as stored: int8 activations still). The LM head takes
the same decode kernels. Only matrices whose sizes fit the tiles (in_features a multiple of
32, out_features of 16) take the matrix path.

RADIXSERVE_PREFILL_PATH=fp32|avx512-bf16|amx-bf16|int8-vnni|int8-avx2 picks a path for
`--dtype auto` (tests and comparisons); a path this CPU cannot run falls back to the default,
with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
from enum import Enum

from radixserve.model import kernels

log = logging.getLogger(__name__)


class PrefillPath(Enum):
    """Where a prefill chunk's matmuls (and, on AMX, its attention) run."""

    FP32 = "fp32"
    AVX512_BF16 = "avx512-bf16"
    AMX_BF16 = "amx-bf16"
    INT8_VNNI = "int8-vnni"
    INT8_AVX2 = "int8-avx2"

    @property
    def unit(self) -> int:
        """The kernels' `unit` argument (bf16.h's MatrixUnit); 0 for float32."""
        units = {PrefillPath.FP32: 0, PrefillPath.AVX512_BF16: 1, PrefillPath.AMX_BF16: 2}
        return units.get(self, 0)  # int8-vnni's ops take no unit

    @property
    def min_rows(self) -> int:
        """Prefill rows in a step from which its matmuls take this path (fewer: float32):
        about where the matrix units start to beat the float32 kernels (docs/cpu.md)."""
        return {
            PrefillPath.FP32: 0,
            PrefillPath.AVX512_BF16: 64,
            PrefillPath.AMX_BF16: 12,
            PrefillPath.INT8_VNNI: VNNI_MIN_ROWS,
            PrefillPath.INT8_AVX2: VNNI_MIN_ROWS,
        }[self]

    @property
    def int8_decode(self) -> bool:
        """Whether decode rows take int8 activations (gemm_vnni.cpp's decode rows, whose
        arithmetic is each row's own, so a row gives the same result whatever shares its
        step; gguf_q8.cpp's for GGUF blocks as stored): on the int8 paths, and on the
        bfloat16 paths where the CPU has AVX-512 VNNI too (all such CPUs so far). Elsewhere
        decode rows run the float32 kernels."""
        if self in (PrefillPath.INT8_VNNI, PrefillPath.INT8_AVX2):
            return True
        return self.bf16 and PrefillPath.INT8_VNNI in available_paths()

    @property
    def int4_panels(self) -> bool:
        """Whether int4 matrices are held as int4-vnni panels (gemm_vnni.cpp's q4_vnni_pack,
        in place of the codes) on which decode rows run: wherever decode rows take int8
        activations from int4 codes (int8-vnni, the bfloat16 paths on a CPU with VNNI). On
        int8-vnni every row runs there; on the bfloat16 paths long chunks go to the matrix
        units, which read the same panels."""
        return self.int8_decode and self is not PrefillPath.INT8_AVX2

    @property
    def q4k_panels(self) -> bool:
        """Whether a GGUF's Q4_K matrices are held as int4-vnni panels (q4k_vnni_pack, in
        place of the blocks) on which decode rows run: where int4 is (`int4_panels`), and on
        int8-avx2, whose every row of such a matrix runs on them (gemm_panels_avx2.cpp)."""
        return self.int4_panels or self is PrefillPath.INT8_AVX2

    @property
    def q6k_panels(self) -> bool:
        """Whether a GGUF's Q6_K matrices are held as q6k-vnni panels (gemm_q6k_vnni.cpp's
        q6k_vnni_pack, in place of the blocks) on which every row runs: on the int8 paths."""
        return self in (PrefillPath.INT8_VNNI, PrefillPath.INT8_AVX2)

    @property
    def stored_blocks(self) -> bool:
        """Whether a GGUF's K-quant blocks are computed as the file stores them (int8-avx2),
        rather than Q4_K repacked into int4 codes holding the same values."""
        return self is PrefillPath.INT8_AVX2

    @property
    def bf16(self) -> bool:
        """Whether the path's GEMMs round to bfloat16 (the gemm_bf16.cpp ops)."""
        return self in (PrefillPath.AVX512_BF16, PrefillPath.AMX_BF16)

    @property
    def attention_unit(self) -> int:
        """The unit prefill attention runs on in bfloat16 (the `unit` of
        paged_prefill_attention_bf16); 0: the float32 kernel."""
        if self is PrefillPath.INT8_VNNI:
            on_vectors = PrefillPath.AVX512_BF16 in available_paths() and not kernels.has_amx()
            return PrefillPath.AVX512_BF16.unit if on_vectors else 0
        return self.unit

    @property
    def attention_min_tokens(self) -> int:
        """Chunk tokens from which prefill attention takes the bfloat16 kernel (the context's
        K and V are rounded to bfloat16 first, whatever the chunk's length). At 2k keys of
        context, the tiles win from fewer tokens than vdpbf16ps does (docs/cpu.md)."""
        return 8 if self is PrefillPath.AMX_BF16 else 16


ENV = "RADIXSERVE_PREFILL_PATH"
# int8-vnni from 8 prefill rows: where its GEMMs clearly beat float32's (docs/cpu.md).
VNNI_MIN_ROWS = 8


@functools.cache
def available_paths() -> tuple[PrefillPath, ...]:
    """The paths this CPU and build run, fastest first (asks Linux for AMX's tile state once;
    builds the kernels if needed). fp32 is always there."""
    if not kernels.load():
        return (PrefillPath.FP32,)
    units = set(kernels.op("matrix_units")())
    order = (
        PrefillPath.AMX_BF16,
        PrefillPath.AVX512_BF16,
        PrefillPath.INT8_VNNI,
        PrefillPath.INT8_AVX2,
    )
    found = [p for p in order if p.value in units]
    return (*found, PrefillPath.FP32)


def default_path() -> PrefillPath:
    """What `--dtype auto` runs on this CPU: AMX where the process may use it, else int8-vnni
    where the CPU has AVX-512 VNNI, else int8-avx2 where it has AVX2, else float32 (see the
    module docstring for avx512-bf16);
    $RADIXSERVE_PREFILL_PATH picks another that the CPU runs (one it cannot: the default,
    with a warning)."""
    paths = available_paths()
    preferred = (
        PrefillPath.AMX_BF16,
        PrefillPath.INT8_VNNI,
        PrefillPath.INT8_AVX2,
        PrefillPath.FP32,
    )
    best = next(p for p in preferred if p in paths)
    wanted = os.environ.get(ENV, "").strip().lower()
    if not wanted:
        return best
    names = [p.value for p in PrefillPath]
    if wanted not in names:
        log.warning("%s=%s is not one of %s; using %s", ENV, wanted, ", ".join(names), best.value)
        return best
    if PrefillPath(wanted) not in paths:
        log.warning(
            "%s=%s: this CPU or build cannot run it (it runs %s); using %s",
            ENV, wanted, ", ".join(p.value for p in paths), best.value,
        )  # fmt: skip
        return best
    return PrefillPath(wanted)


def describe(path: PrefillPath) -> str:
    """One line for the start-up log: what prefill and decode run on."""
    if path is PrefillPath.FP32:
        return "prefill path fp32: prefill and decode run the model dtype's matmuls"
    if path is PrefillPath.INT8_AVX2:
        return (
            "prefill: int8-avx2 (Q4_K and Q6_K matrices as panels: every row on int8 "
            "activations; other GGUF K-quant blocks as stored (a mixed qkv, Q5_K): decode rows "
            f"and shorter chunks on int8 activations, chunks of {path.min_rows}+ rows on panels "
            "packed for the call (Q4_K and Q6_K parts) or the float32 kernels; other codes and "
            "attention float32)"
        )
    attention = {0: "float32", 1: "bf16 (vdpbf16ps)", 2: "bf16 on AMX tiles"}[path.attention_unit]
    how = (
        "weights dequantized to bf16 panels"
        if path.bf16
        else "activations quantized to int8 per 32, integer dot products with the codes"
    )
    if path.int8_decode and path.bf16:
        decode = (
            "decode rows and shorter chunks: int8 activations on int4 panels packed once "
            "(which the chunks' tiles read too) and on other codes as stored, the LM head's too"
        )
    elif path.int8_decode:
        decode = (
            "decode rows and shorter chunks: int8 activations too (int4, on int8-vnni Q6_K too: "
            "every row on panels packed once), the LM head's too"
        )
    else:
        decode = (
            "decode and LM head: float32 GEMV kernels (GGUF blocks as stored: int8 activations)"
        )
    return (
        f"prefill: {path.value} (chunks of {path.min_rows}+ rows: {how}, float32 sums; "
        f"attention {attention}); {decode}"
    )
