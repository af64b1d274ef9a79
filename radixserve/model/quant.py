"""Weight-only quantized linears: int4 and int8 in groups of 32 (GGUF blocks whose values they
hold, repacked), and GGUF blocks as the file stores them (kind "gguf": Q4_0 ... IQ4_XS, several
kinds in one matrix where the file mixed them).

A GGUF checkpoint's own blocks load as they are (model/gguf_quant.py), so the default model
computes with exactly the file's weights; `--quantization int4|int8` quantizes the others here.
Inputs and outputs stay in the model dtype; accumulation is float32. On the CPU, a step's
prefill rows may run on the matrix units in bfloat16 (kernels/matrix.py: `PrefillPath`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import kernels
from radixserve.model.kernels.matrix import PrefillPath, available_paths
from radixserve.values import QUANTIZATIONS

GROUP = 32
F32 = torch.float32
# GGUF K-quant blocks as stored take int8-vnni's GEMM from this many rows, not the path's 8: it
# packs them into panels at every call, which the decode rows' kernel (gguf_gemm_q8) does not
# (other blocks run the float32 block kernels there, which keep the path's threshold). This
# Zen 4, GEMM vs rows at 8 rows: LM head 49152 x 2048 Q6_K 16.4 vs 10.6 ms, 2048 x 8192 Q6_K
# 2.9 vs 1.8, 8192 x 2048 Q4_K 1.7 vs 1.5; at 12, 17.9 vs 17.7, 2.5 vs 2.9, 2.0 vs 2.3. The
# head of an 8-sequence decode step is such a call.
GGUF_VNNI_MIN_ROWS = 12
# The kinds held as panels, whose rows `QuantizedWeight.from_panels` reads back and on which every
# row of a call runs (int4-vnni: int4's codes or Q4_K's; q6k-vnni: Q6_K's).
_PANEL_KINDS = ("int4-vnni", "q6k-vnni")


@dataclass
class QuantizedWeight:
    """W [out, in] as codes plus per-group float32 scale (and min for int4), or GGUF blocks.

    int4: qs [out, in/2] uint8, byte j of a group = element j | element j+16 << 4; w = s*q + m.
    int8: qs [out, in] int8; w = s*q.
    gguf: qs uint8 [bytes]: the blocks of every row, as the file stores them; layout int64
          [parts, 2]: consecutive runs of rows as (rows, GGML type number); `cols` = in.
          `scale` is empty.
    int4-vnni: int4's codes, scales and mins in int8-vnni's panels of 16 rows (`to_panels`):
          qs [P * G, 256] uint8, scale / minv [P * G, 16] (P = out / 16, G = in / 32),
          float16 where that holds them exactly (a GGUF's Q4_0 / Q4_1), else float32;
          `cols` = in. From Q4_K blocks (`repacked_rows` with `panels`), scale / minv are
          uint8 [P * in / 256, 192]: per panel and super-block of 8 groups the 16 rows'
          float32 d (-dmin) and [8][16] uint8 sub-block scales (mins), 4.75 bits a weight
          in all where float32 factors take 6, for the same float32 values d * sc.
    q6k-vnni: Q6_K blocks in the int8 paths' panels of 16 rows (gemm_q6k_vnni.cpp's
          q6k_vnni_pack, `_k_panels`): qs [P * G, 384] uint8 (6-bit codes), scale uint8
          [P * in / 256, 320] (float32 d and int8 sub-block scales), no mins; `cols` = in.
          The blocks' own values in 1% more bytes.
    """

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor  # [out, in/32]
    minv: torch.Tensor | None  # [out, in/32], int4 only
    layout: torch.Tensor | None = None  # gguf only
    cols: int = 0  # gguf and int4-vnni only

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        if self.kind == "gguf":
            assert self.layout is not None
            return int(self.layout[:, 0].sum()), self.cols
        if self.kind == "int4-vnni":
            return self.qs.numel() * 2 // self.cols, self.cols
        if self.kind == "q6k-vnni":
            return self.qs.numel() * 4 // (3 * self.cols), self.cols
        return self.scale.shape[0], self.scale.shape[1] * GROUP

    def to_panels(self, in_place: bool = False, empty: Empty | None = None) -> QuantizedWeight:
        """This int4 weight as int4-vnni: each panel of 16 rows holds, for every group, the
        16 rows' code bytes 4j..4j+3 side by side (j = 0..3) and the group's 16 scales and
        mins, the order gemm_vnni.cpp reads (q4_vnni_pack): the same values in as many bytes,
        meant to replace the int4 tensors (QuantLinear.use_weight keeps only one). With
        `in_place`, written over this weight's own tensors (which then hold the panels). With
        `empty` (e.g. a hugepages.WeightArena's), in new tensors from it, the factors in
        float16 where that holds them exactly (a GGUF's Q4_0 / Q4_1 d and m): 5 bits a weight
        where float32 factors take 6."""
        assert self.kind == "int4" and self.minv is not None
        (n, k), groups = self.shape, self.scale.shape[1]
        shape = (n // 16 * groups, 16)
        if in_place:
            words, scale, minv = (
                self.qs.view(-1, 256),
                self.scale.view(shape),
                self.minv.view(shape),
            )
            src = (self.qs.clone(), self.scale.clone(), self.minv.clone())
        else:
            words = (empty or _torch_empty)((n // 16 * groups, 256), torch.uint8)
            scale, minv = torch.empty(shape), torch.empty(shape)
            src = (self.qs, self.scale, self.minv)
        kernels.op("q4_vnni_pack")(*src, words, scale, minv)
        if empty is not None:
            halves = scale.half(), minv.half()
            if torch.equal(halves[0].float(), scale) and torch.equal(halves[1].float(), minv):
                scale, minv = halves
            scale, minv = (empty(shape, f.dtype).copy_(f) for f in (scale, minv))
        return QuantizedWeight("int4-vnni", words, scale, minv, cols=k)

    def from_panels(self, index: torch.Tensor | None = None) -> QuantizedWeight:
        """This int4-vnni weight (its rows `index`, or all) as int4; a q6k-vnni one as the
        Q6_K blocks it was packed from, byte for byte."""
        if self.kind == "q6k-vnni":
            return self._q6k_blocks(index)
        assert self.kind == "int4-vnni" and self.minv is not None
        (n, _), groups = self.shape, self.cols // GROUP
        rows = torch.arange(n) if index is None else index
        panel, col = rows // 16, rows % 16
        words = self.qs.view(n // 16, groups, 4, 16, 4)[panel, :, :, col, :]
        scale = self._factors(self.scale).view(n // 16, groups, 16)[panel, :, col]
        minv = self._factors(self.minv).view(n // 16, groups, 16)[panel, :, col]
        qs = words.reshape(rows.numel(), groups * GROUP // 2).contiguous()
        return QuantizedWeight("int4", qs, scale.contiguous(), minv.contiguous())

    def _q6k_blocks(self, index: torch.Tensor | None) -> QuantizedWeight:
        """q6k-vnni rows `index` (or all) as gguf Q6_K blocks (the layout gemm_q6k_vnni.cpp's
        opening comment gives, undone)."""
        (n, k), groups, supers = self.shape, self.cols // GROUP, self.cols // 256
        rows = torch.arange(n) if index is None else index
        panel, col, m = rows // 16, rows % 16, rows.numel()
        words = self.qs.view(n // 16, groups, 384)[panel]  # [m, G, 384]
        lo = words[..., :256].reshape(m, groups, 4, 16, 4)[torch.arange(m), :, :, col]
        top = words[..., 256:].reshape(m, groups, 2, 16, 4)[torch.arange(m), :, :, col]
        low = torch.cat([(lo & 0x0F).reshape(m, groups, 16), (lo >> 4).reshape(m, groups, 16)], -1)
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 1, 4, 1)
        high = ((top[:, :, :, None, :] >> shifts) & 3).reshape(m, groups, 32)  # 16k + 4i + b
        c = (low | (high << 4)).reshape(m, supers, 2, 4, 32)  # [m, S, half h, t, e]
        ql = (c[:, :, :, 0:2] & 0x0F) | ((c[:, :, :, 2:4] & 0x0F) << 4)  # [m, S, 2, 2, 32]
        qh = torch.zeros_like(c[:, :, :, 0])  # [m, S, 2, 32]
        for t in range(4):
            qh |= ((c[:, :, :, t] >> 4) & 3) << (2 * t)
        factors = self.scale.view(n // 16, supers, 320)[panel]  # [m, S, 320]
        sc = factors[..., 64:].reshape(m, supers, 16, 16)[torch.arange(m), :, :, col]
        d = factors[..., :64].contiguous().view(torch.float32)[torch.arange(m), :, col]
        d16 = d.to(torch.float16).contiguous().view(torch.uint8).view(m, supers, 2)
        blocks = torch.cat([ql.reshape(m, supers, 128), qh.reshape(m, supers, 64), sc, d16], -1)
        layout = torch.tensor([[m, _GGML_Q6_K]], dtype=torch.int64)
        return QuantizedWeight(
            "gguf", blocks.reshape(-1).contiguous(), torch.empty(0), None, layout, k
        )

    @staticmethod
    def _factors(f: torch.Tensor) -> torch.Tensor:
        """int4-vnni factors as float32 [P * G, 16] (Q4_K's as stored: d * sc, as the
        kernels compute them)."""
        if f.dtype != torch.uint8:
            return f.float()
        k = f.view(-1, 192)
        d = k[:, :64].contiguous().view(torch.float32)  # [P * S, 16]
        sub = k[:, 64:].reshape(-1, 8, 16).float()
        return (d[:, None, :] * sub).reshape(-1, 16)

    def kernel_layout(self) -> torch.Tensor:
        """The int64 [parts, 2] (rows, kind number) list our kernels read (decode_layers'
        per-projection layout); kernels must be loaded."""
        if self.layout is not None:
            return self.layout
        return torch.tensor([[self.shape[0], kernels.quant_kind_code(self.kind)]])

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the codes (what huge-page packing moves)."""
        return [t for t in (self.qs, self.scale, self.minv) if t is not None and t.numel()]

    def with_tensors(self, new: list[torch.Tensor]) -> QuantizedWeight:
        """The same weight over `new`, copies of `tensors()` in their order."""
        it = iter(new)
        qs = next(it)
        scale = next(it) if self.scale.numel() else self.scale
        minv = next(it) if self.minv is not None and self.minv.numel() else self.minv
        return QuantizedWeight(self.kind, qs, scale, minv, self.layout, self.cols)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 rows `index` [n] of the weight (an embedding lookup in the codes)."""
        index = index.to(self.qs.device)
        if self.kind in _PANEL_KINDS:
            return self.from_panels(index).dequantize()
        if self.kind == "int4" or self.kind == "int8":
            n = self.scale.shape[0]
            qs = self.qs.view(n, -1)[index]
            minv = self.minv[index] if self.minv is not None else None
            return QuantizedWeight(self.kind, qs, self.scale[index], minv).dequantize()
        assert self.layout is not None
        if self.layout.shape[0] != 1:  # rows of several kinds: rare, and small
            return self.dequantize()[index]
        n, kind = (int(v) for v in self.layout[0])
        blocks = self.qs.view(n, -1)[index].reshape(-1)
        layout = torch.tensor([[index.numel(), kind]], dtype=torch.int64)
        return QuantizedWeight("gguf", blocks, self.scale, None, layout, self.cols).dequantize()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes stand for."""
        if self.kind in _PANEL_KINDS:
            return self.from_panels().dequantize()
        out = torch.empty(self.shape, dtype=torch.float32, device=self.qs.device)
        if self.kind == "gguf":
            return self._dequantize_gguf(out)
        if self.qs.device.type == "cpu" and kernels.loaded():
            if self.kind == "int4":
                kernels.op("q4_dequant")(self.qs, self.scale, self.minv, out)
            else:
                kernels.op("q8_dequant")(self.qs, self.scale, out)
            return out
        n, k = self.shape
        if self.kind == "int4":
            assert self.minv is not None
            q = self.qs.view(n, k // GROUP, GROUP // 2)
            codes = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
            w = codes * self.scale[..., None] + self.minv[..., None]
        else:
            w = self.qs.view(n, k // GROUP, GROUP).float() * self.scale[..., None]
        return out.copy_(w.view(n, k))

    def _dequantize_gguf(self, out: torch.Tensor) -> torch.Tensor:
        """gguf kind: by our kernel on the CPU, else by the gguf package's own code."""
        assert self.layout is not None
        if self.qs.device.type == "cpu" and kernels.loaded():
            kernels.op("gguf_dequant")(self.qs, self.layout, out)
            return out
        import gguf

        raw, row = self.qs.cpu().numpy(), 0
        for rows, kind in self.layout.tolist():
            qtype = gguf.GGMLQuantizationType(kind)
            nbytes = rows * gguf.quants.quant_shape_to_byte_shape((self.cols,), qtype)[0]
            part = raw[:nbytes].reshape(rows, -1)
            w = gguf.quants.dequantize(part, qtype)
            out[row : row + rows] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            raw, row = raw[nbytes:], row + rows
        return out

    def concat(self, other: QuantizedWeight) -> QuantizedWeight:
        """Rows of self then rows of other (fusing q/k/v or gate/up). GGUF blocks of different
        kinds concatenate into parts; int4 / int8 only with their own kind."""
        if self.kind == "gguf" and other.kind == "gguf":
            assert self.layout is not None and other.layout is not None
            assert self.cols == other.cols
            return QuantizedWeight(
                "gguf",
                torch.cat([self.qs, other.qs]),
                self.scale,
                None,
                _merged_layout(torch.cat([self.layout, other.layout])),
                self.cols,
            )
        assert self.kind == other.kind
        minv = None
        if self.minv is not None and other.minv is not None:
            minv = torch.cat([self.minv, other.minv])
        return QuantizedWeight(
            self.kind,
            torch.cat([self.qs, other.qs]),
            torch.cat([self.scale, other.scale]),
            minv,
        )

    def to(self, device: torch.device) -> QuantizedWeight:
        """The same codes on `device`."""
        minv = self.minv.to(device) if self.minv is not None else None
        return QuantizedWeight(
            self.kind, self.qs.to(device), self.scale.to(device), minv, self.layout, self.cols
        )


def _merged_layout(layout: torch.Tensor) -> torch.Tensor:
    """`layout` with neighbouring parts of one kind joined."""
    merged: list[list[int]] = []
    for rows, kind in layout.tolist():
        if merged and merged[-1][1] == kind:
            merged[-1][0] += rows
        else:
            merged.append([rows, kind])
    return torch.tensor(merged, dtype=torch.int64)


# The GGML block types (by GGML's numbers) whose values gemm.cpp's int8 / int4 codes hold
# exactly: w = d q (Q8_0; Q5_0 with q - 16 in [-16, 15]) or w = s q + m with q a nibble (Q4_0:
# m = -8 d; Q4_1; Q4_K: s = d sc, m = -(dmin m) of each sub-block of 32).
_GGML_Q4_0, _GGML_Q4_1, _GGML_Q5_0, _GGML_Q8_0, _GGML_Q4_K = 2, 3, 6, 8, 12
_GGML_Q2_K, _GGML_Q3_K, _GGML_Q5_K, _GGML_Q6_K, _GGML_IQ4_NL, _GGML_IQ4_XS = 10, 11, 13, 14, 20, 23
_GGML_IQ2_3 = frozenset({16, 17, 18, 21, 22})  # IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, IQ2_S
_AS_INT8 = frozenset({_GGML_Q8_0, _GGML_Q5_0})
_AS_INT4 = frozenset({_GGML_Q4_0, _GGML_Q4_1, _GGML_Q4_K})
# The types whose chunks int8-vnni runs on int8 activations (gemm_vnni.cpp's kquant_gemm_vnni).
_K_QUANT_TYPES = _GGML_IQ2_3 | {
    _GGML_Q2_K, _GGML_Q3_K, _GGML_Q4_K, _GGML_Q5_K, _GGML_Q6_K, _GGML_IQ4_NL, _GGML_IQ4_XS
}  # fmt: skip


def repacked(w: QuantizedWeight, k_quants: bool = True) -> QuantizedWeight:
    """A GGUF weight whose every part is Q8_0 / Q5_0 blocks as int8, or Q4_0 / Q4_1 / Q4_K
    blocks as int4: the same values, each group's scale (and min) as float32 beside its codes,
    for gemm.cpp's kernels (tuned further than the block kernels; docs/models.md has the
    gain and the memory it costs); any other weight as it is. Without `k_quants`, Q4_K stays
    as stored (int8-avx2 reads it at 4.5 bits a weight, not 6)."""
    return repacked_rows([w], k_quants)


Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def repacked_rows(
    parts: Sequence[QuantizedWeight],
    k_quants: bool = True,
    empty: Empty = _torch_empty,
    path: PrefillPath | None = None,
) -> QuantizedWeight:
    """The rows of `parts` (of one kind) one after another, as `repacked` holds them, in
    tensors from `empty` (e.g. a hugepages.WeightArena's): blocks that repack are written
    into the codes part by part, blocks kept as stored are copied in one after another, and
    other codes concatenated and copied in. On a `path` that holds them as panels, Q4_K blocks
    go straight into int4-vnni panels with their factors as stored (`q4k_panels`) and Q6_K
    blocks into q6k-vnni ones (`q6k_panels`), where the shapes allow (`_k_panels`), and
    other blocks that repack into int4 into int4-vnni panels (`int4_panels`,
    `QuantizedWeight.to_panels`)."""
    if path is not None:
        held = {_GGML_Q4_K: path.q4k_panels, _GGML_Q6_K: path.q6k_panels}
        for ggml_type, on in held.items():
            if on and _panels_fit(parts, ggml_type):
                return _k_panels(parts, empty, ggml_type)
    target = _repack_target(parts, k_quants)
    rows, cols = sum(p.shape[0] for p in parts), parts[0].cols
    if target == "int4" and path is not None and path.int4_panels and rows % 16 == 0:
        # int4 as this path holds it, into `empty` from codes made here
        return repacked_rows(parts, k_quants).to_panels(empty=empty)
    if target is None:
        if all(p.kind == "gguf" and p.layout is not None for p in parts):
            return _blocks_in(parts, empty)
        w = functools.reduce(QuantizedWeight.concat, parts)
        if empty is _torch_empty:
            return w
        return w.with_tensors([empty(tuple(t.shape), t.dtype).copy_(t) for t in w.tensors()])
    # In the order of `tensors()`: codes, scales, mins.
    codes = (
        empty((rows, cols // 2), torch.uint8)
        if target == "int4"
        else empty((rows, cols), torch.int8)
    )
    scale, at = empty((rows, cols // GROUP), F32), 0
    mins = empty((rows, cols // GROUP), F32) if target == "int4" else torch.empty(0)
    for p in parts:
        n = p.shape[0]
        rows_mins = mins[at : at + n] if mins.numel() else mins
        _repack_into(p, codes[at : at + n], scale[at : at + n], rows_mins)
        at += n
    return QuantizedWeight(target, codes, scale, mins if target == "int4" else None)


# GGUF K-quants packed at load into panels of 16 rows (gemm_vnni.cpp, gemm_q6k_vnni.cpp): the
# path whose kernels pack and read them, the bytes of codes per panel and group, of each factor
# tensor per panel and super-block, the packing op and the QuantizedWeight kind.
_PANELS = {
    _GGML_Q4_K: (PrefillPath.INT8_AVX2, 256, (192, 192), "q4k_vnni_pack", "int4-vnni"),
    _GGML_Q6_K: (PrefillPath.INT8_AVX2, 384, (320,), "q6k_vnni_pack", "q6k-vnni"),
}


def _panels_fit(parts: Sequence[QuantizedWeight], ggml_type: int) -> bool:
    """Whether every part is blocks of `ggml_type` (a key of `_PANELS`) on the CPU, of rows in
    whole panels (16) and columns in whole blocks (256), and the kernels that pack and read
    them are here (AVX2)."""
    cols = parts[0].cols
    return (
        cols % 256 == 0
        and all(
            p.kind == "gguf"
            and p.layout is not None
            and p.cols == cols
            and p.qs.device.type == "cpu"
            and set(p.layout[:, 1].tolist()) == {ggml_type}
            and p.shape[0] % 16 == 0
            for p in parts
        )
        and _PANELS[ggml_type][0] in available_paths()
    )


def _k_panels(parts: Sequence[QuantizedWeight], empty: Empty, ggml_type: int) -> QuantizedWeight:
    """The rows of `parts` (blocks of `ggml_type`, a key of `_PANELS`) as its panels, written
    part by part: Q4_K as int4-vnni with the blocks' own factors (uint8 scale / minv), Q6_K as
    q6k-vnni (QuantizedWeight)."""
    _, word_bytes, factor_bytes, op, kind = _PANELS[ggml_type]
    rows, cols = sum(p.shape[0] for p in parts), parts[0].cols
    groups, supers = cols // GROUP, cols // 256
    words = empty((rows // 16 * groups, word_bytes), torch.uint8)
    factors = [empty((rows // 16 * supers, b), torch.uint8) for b in factor_bytes]
    pack, at = kernels.op(op), 0
    for p in parts:
        n = p.shape[0] // 16
        rows_of = [f[at * supers : (at + n) * supers] for f in factors]
        pack(p.qs, cols, words[at * groups : (at + n) * groups], *rows_of)
        at += n
    minv = factors[1] if len(factors) > 1 else None
    return QuantizedWeight(kind, words, factors[0], minv, cols=cols)


def _blocks_in(parts: Sequence[QuantizedWeight], empty: Empty) -> QuantizedWeight:
    """GGUF `parts` as one weight, their blocks copied one after another into `empty`'s."""
    qs, at = empty((sum(p.qs.numel() for p in parts),), torch.uint8), 0
    for p in parts:
        qs[at : at + p.qs.numel()] = p.qs
        at += p.qs.numel()
    layout = _merged_layout(torch.cat([p.layout for p in parts if p.layout is not None]))
    return QuantizedWeight("gguf", qs, parts[0].scale, None, layout, parts[0].cols)


def _repack_target(parts: Sequence[QuantizedWeight], k_quants: bool) -> str | None:
    """The codes ("int8" or "int4") every part of `parts` repacks into, if there are any:
    GGUF blocks of `_AS_INT8` kinds, or of `_AS_INT4` kinds (Q4_K only with `k_quants`),
    rows of whole blocks and groups of one width."""
    cols = parts[0].cols
    if any(p.kind != "gguf" or p.layout is None or p.cols != cols for p in parts):
        return None
    kinds = {kind for p in parts if p.layout is not None for kind in p.layout[:, 1].tolist()}
    if not kinds <= _AS_INT8 | _AS_INT4 or any(cols % _block_size(k)[0] for k in kinds):
        return None
    if kinds <= _AS_INT8:
        return "int8"
    return "int4" if kinds <= (_AS_INT4 if k_quants else _AS_INT4 - {_GGML_Q4_K}) else None


def _block_size(kind: int) -> tuple[int, int]:
    """(weights, bytes) of one block of GGML type `kind`, as the gguf package knows them."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]


def _repack_into(
    w: QuantizedWeight, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor
) -> None:
    """Write GGUF weight `w`'s rows as codes, scales (and mins): by our kernel on the CPU,
    else by `_as_codes` (the reference the kernel is tested against)."""
    assert w.layout is not None
    if w.qs.device.type == "cpu" and kernels.loaded():
        kernels.op("gguf_repack")(w.qs, w.layout, codes, scale, mins)
        return
    at, row = 0, 0
    for rows, kind in w.layout.tolist():
        weights, nbytes = _block_size(kind)
        size = rows * w.cols // weights * nbytes
        q, s, m = _as_codes(w.qs[at : at + size].view(rows, -1), kind, w.cols, nbytes)
        codes[row : row + rows] = q.view(codes.dtype)
        scale[row : row + rows] = s
        if m is not None:
            mins[row : row + rows] = m
        at, row = at + size, row + rows


def _f16(b: torch.Tensor) -> torch.Tensor:
    """The float16 in the last dimension's 2 bytes of `b`, as float32."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _as_codes(
    b: torch.Tensor, kind: int, cols: int, block_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of GGML blocks `b` [rows, bytes] of `block_bytes` a block as (codes, scale, min):
    int8 codes [rows, cols] (no min), or int4 codes [rows, cols / 2] in QuantizedWeight's
    nibble order."""
    rows, groups = b.shape[0], cols // GROUP
    if kind == _GGML_Q4_K:
        k = b.view(rows, -1, block_bytes)
        d, dmin, sc = _f16(k[..., 0:2]), _f16(k[..., 2:4]), k[..., 4:16].int()
        # Sub-block j's 6-bit scale and min (llama.cpp's get_scale_min_k4).
        low, high = sc[..., 0:4], sc[..., 4:8]
        scale = torch.cat([low & 63, (sc[..., 8:12] & 0x0F) | ((low >> 6) << 4)], -1)
        minimum = torch.cat([high & 63, (sc[..., 8:12] >> 4) | ((high >> 6) << 4)], -1)
        s = (d[..., None] * scale.float()).reshape(rows, groups)
        m = (-(dmin[..., None] * minimum.float())).reshape(rows, groups)
        # Bytes 32p + e: sub-block 2p's weight e in the low nibble, sub-block 2p + 1's in the high.
        qs = k[..., 16:].reshape(rows, -1, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, groups, 32)
        return (q[..., :16] | (q[..., 16:] << 4)).reshape(rows, cols // 2), s, m
    k = b.view(rows, groups, block_bytes)
    d = _f16(k[..., 0:2])
    if kind == _GGML_Q8_0:
        return k[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), d, None
    if kind == _GGML_Q5_0:
        qh = k[..., 2:6].contiguous().view(torch.int32)  # bit e: weight e's fifth bit
        high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
        nibbles = torch.cat([k[..., 6:] & 0x0F, k[..., 6:] >> 4], -1).int()
        q = (nibbles | (high << 4)) - 16
        return q.to(torch.int8).reshape(rows, cols), d, None
    if kind == _GGML_Q4_1:
        return k[..., 4:].reshape(rows, cols // 2), d, _f16(k[..., 2:4])
    return k[..., 2:].reshape(rows, cols // 2), d, -8.0 * d  # Q4_0: w = d (q - 8)


def quantize(w: torch.Tensor, kind: str) -> QuantizedWeight:
    """Round a float weight [out, in] (in divisible by 32) to `kind` codes, per group of 32."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    tiny = torch.finfo(torch.float32).tiny
    if kind == "int8":
        scale = g.abs().amax(-1) / 127.0
        q = torch.round(g / scale.clamp_min(tiny)[..., None]).clamp(-128, 127).to(torch.int8)
        return QuantizedWeight("int8", q.reshape(n, k).contiguous(), scale.contiguous(), None)
    if kind == "int4":
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15.0
        q = torch.round((g - lo[..., None]) / scale.clamp_min(tiny)[..., None]).clamp(0, 15)
        q = q.to(torch.uint8)
        packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
        return QuantizedWeight(
            "int4", packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous()
        )
    raise ValueError(f"unknown quantization {kind!r}; use one of {QUANTIZATIONS}")


class QuantLinear:
    """y = x W^T (+ b) over a QuantizedWeight: our kernels on CPU (any number of rows: the
    weight is dequantized a few rows at a time inside the GEMM, never whole), a dequantized
    dense GEMM elsewhere.

    On the CPU with a `prefill_path` other than fp32, the rows after the first `fp32_rows`
    of a call (a step's prefill chunks; its decode rows come first) run on the matrix units
    when there are at least `prefill_path.min_rows` of them; the rest run the one-row kernels
    (float32, or on the int8 paths their decode-row kernels), so a decode row's result never
    depends on what shares its step. On int8-vnni an int4 matrix is held as int4-vnni panels,
    on which every row runs, decode or prefill, in one call; on the bfloat16 paths, where the
    CPU has AVX-512 VNNI too, it is held as the same panels, whose decode rows and short
    chunks run as on int8-vnni and whose long chunks the matrix units read."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.bias, self.prefill_path = bias, PrefillPath.FP32
        self.out_features, self.in_features = weight.shape
        self._kernel: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._matrix: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._rows: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._k_quants: bool | None = None  # `_k_quant_blocks`, found once per weight
        # As given (int4-vnni panels from the loader stay panels): `use_prefill_path` then
        # holds it as its path reads it.
        self.weight = weight

    def use_weight(self, weight: QuantizedWeight, in_place: bool = False) -> None:
        """Compute with `weight` (the same matrix, e.g. moved in memory) from now on, int4
        held as int4-vnni panels where the path's decode rows read them (`int4_panels`;
        with `in_place`, in int4's own tensors) and as int4 elsewhere; panels (a Q4_K's from
        the loader) stay panels where the path reads them (`q4k_panels`)."""
        path = self.prefill_path
        if weight.kind == "int4-vnni" and not path.q4k_panels:
            weight = weight.from_panels()
        elif weight.kind == "q6k-vnni" and not path.q6k_panels:
            weight = weight.from_panels()  # the blocks again
        elif weight.kind == "int4" and path.int4_panels:
            weight = weight.to_panels(in_place)
        self.weight, self._kernel, self._matrix, self._rows = weight, None, None, None
        self._k_quants = None

    def use_prefill_path(self, path: PrefillPath, in_place: bool = False) -> None:
        """Run prefill rows on `path` from now on (fp32 where it does not take this matrix:
        sizes off the tiles, in_features a multiple of 32 and out_features of 16, or GGUF
        blocks as stored on the bfloat16 paths, which read int4 / int8 codes only). Where
        the path holds int4 as int4-vnni panels (`int4_panels`), an int4 weight is repacked
        into them (and back on leaving it; `in_place`: over the int4 tensors, which nothing
        else may read)."""
        if self.weight.kind in ("gguf", "q6k-vnni"):  # gguf_q8.cpp: every kind as stored
            fits = path.int8_decode or path.bf16  # bf16: int8 decode rows (_int8_rows)
        else:  # int4 / int8 codes; int8-avx2 leaves them (not its panels) on the float32 kernels
            fits = (
                (path is not PrefillPath.INT8_AVX2 or self.weight.kind == "int4-vnni")
                and self.in_features % 32 == 0
                and self.out_features % 16 == 0
            )
        self.prefill_path = path if fits else PrefillPath.FP32
        self.use_weight(self.weight, in_place)

    def _cpu_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """kernel(x, out) for float32 x [M, in] on the CPU, bound to this weight once (a
        decode step makes ~120 of these calls)."""
        if self._kernel is None and kernels.loaded() and self.weight.qs.device.type == "cpu":
            w = self.weight
            if w.kind == "gguf":
                gguf_gemm, blocks, layout = kernels.op("gguf_gemm"), w.qs, w.layout
                self._kernel = lambda x, out: gguf_gemm(x, blocks, layout, out)
            elif w.kind == "int4":
                q4, qs, scale, minv = kernels.op("q4_gemm"), w.qs, w.scale, w.minv
                self._kernel = lambda x, out: q4(x, qs, scale, minv, out)
            elif w.kind == "int4-vnni":  # every row on the panels (gemm_vnni.cpp)
                v4, qs, scale, minv = kernels.op("q4_gemm_vnni"), w.qs, w.scale, w.minv
                self._kernel = lambda x, out: v4(x, qs, scale, minv, out)
            elif w.kind == "q6k-vnni":  # every row on the panels (gemm_q6k_vnni.cpp)
                v6, qs, scale = kernels.op("q6k_gemm_vnni"), w.qs, w.scale
                self._kernel = lambda x, out: v6(x, qs, scale, out)
            else:
                q8, qs, scale = kernels.op("q8_gemm"), w.qs, w.scale
                self._kernel = lambda x, out: q8(x, qs, scale, out)
        return self._kernel

    @property
    def prefill_rows_fp32(self) -> bool:
        """Whether this matrix's prefill chunks run the float32 kernels whatever the path
        (fp32, or GGUF blocks as stored, whose long chunks the bfloat16 tiles do not read)."""
        return self.prefill_path is PrefillPath.FP32 or (
            self.prefill_path.bf16 and self.weight.kind == "gguf"
        )

    def _int8_rows(self) -> bool:
        """Whether decode rows (and chunks off the matrix units) take int8 activations: where
        the path's do (`int8_decode`), and for GGUF blocks as stored on any bfloat16 path
        (whose tiles read int4 / int8 codes only: the float32 block kernels read a K-quant at
        a fraction of gguf_q8's speed per byte)."""
        path = self.prefill_path
        return path.int8_decode or (path.bf16 and self.weight.kind == "gguf")

    def _on_panels(self) -> bool:
        """Whether every row of this matrix, decode or prefill, runs in one call on int4-vnni
        panels (on int8-vnni; the bfloat16 paths' matrix units take their long chunks)."""
        return self.weight.kind in _PANEL_KINDS and not self.prefill_path.bf16

    def decode_operands(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(codes, scales, mins or None, layout) as the kernels take this matrix for decode
        rows (`decode_layers`' weights, `quant_linear` in layers.cpp): where they take int8
        activations (`_int8_rows`), their
        decode rows' kinds (GGUF blocks + gguf-q8; int8 codes as int8-vnni; int4-vnni panels
        as they are), else the codes' own. Kernels must be loaded."""
        w = self.weight
        if self._int8_rows() and w.kind == "gguf":  # blocks as stored
            assert w.layout is not None
            layout = w.layout.clone()
            layout[:, 1] += kernels.quant_kind_code("gguf-q8")
            return w.qs, w.scale, w.minv, layout
        if self.prefill_path.int8_decode and w.kind == "int8":
            code = kernels.quant_kind_code("int8-vnni")
            return w.qs, w.scale, w.minv, torch.tensor([[self.out_features, code]])
        return w.qs, w.scale, w.minv, w.kernel_layout()

    def _rows_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """kernel(x, out) for the rows that stay off the matrix units (decode rows, short
        chunks; int4-vnni on int8-vnni: all rows): where they take int8 activations, their
        decode rows' kernel, on `decode_operands`, else the float32 one."""
        if self._rows is None:
            self._rows = self._cpu_kernel()
            kind = self.weight.kind
            if self._rows is not None and self._int8_rows() and kind not in _PANEL_KINDS:
                qs, scale, _, layout = self.decode_operands()
                if kind == "gguf":
                    q8 = kernels.op("gguf_gemm_q8")
                    self._rows = lambda x, out: q8(x, qs, layout, out)
                else:
                    v8 = kernels.op("q8_gemv_vnni")
                    self._rows = lambda x, out: v8(x, qs, scale, out)
        return self._rows

    def _matrix_kernel(self, silu: bool = False) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """kernel(x, out) on the matrix units of `prefill_path` (with `silu`: the gated
        activation of a [gate; up] matrix), bound once."""
        if silu:
            return self._bind_matrix("_silu")
        if self._matrix is None:
            self._matrix = self._bind_matrix("")
        return self._matrix

    def _bind_matrix(self, suffix: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
        w, path = self.weight, self.prefill_path
        int8_parts = path in (PrefillPath.INT8_VNNI, PrefillPath.INT8_AVX2) or (
            path.bf16 and path.int8_decode
        )
        if w.kind == "gguf" and int8_parts:
            # Blocks as stored (the bf16 paths' tiles read int4 / int8 codes only): K-quant
            # parts on int8 activations, on AVX-512 VNNI as their decode rows, on int8-avx2 (Q4_K
            # and Q6_K) on panels packed for the call; the rest the float32 kernels.
            gguf_gemm, blocks, layout = kernels.op("gguf_gemm"), w.qs, w.layout
            return lambda x, out: gguf_gemm(x, blocks, layout, out, True)
        if w.kind == "gguf":  # long chunks of blocks as stored: the float32 kernels
            kernel = self._cpu_kernel()
            assert kernel is not None
            return kernel
        if path is PrefillPath.INT8_VNNI:  # int8 activations (gemm_vnni.cpp)
            v8, qs, scale = kernels.op("q8_gemm_vnni"), w.qs, w.scale
            return lambda x, out: v8(x, qs, scale, out)
        if w.kind in ("int4", "int4-vnni"):
            name = ("q4_gemm_bf16" if w.kind == "int4" else "q4v_gemm_bf16") + suffix
            q4, qs, scale, minv, unit = kernels.op(name), w.qs, w.scale, w.minv, path.unit
            return lambda x, out: q4(x, qs, scale, minv, out, unit)
        q8, qs, scale, unit = kernels.op("q8_gemm_bf16" + suffix), w.qs, w.scale, path.unit
        return lambda x, out: q8(x, qs, scale, out, unit)

    def _k_quant_blocks(self) -> bool:
        """Whether this matrix is GGUF blocks as stored whose every part int8-vnni's chunks
        meet with int8 activations (_K_QUANT_TYPES)."""
        w = self.weight
        if self._k_quants is None:
            self._k_quants = (
                w.kind == "gguf"
                and w.layout is not None
                and set(w.layout[:, 1].tolist()) <= _K_QUANT_TYPES
            )
        return self._k_quants

    def _on_matrix_units(self, x: torch.Tensor, fp32_rows: int) -> bool:
        """Whether a call over x [M, in] runs its rows past `fp32_rows` on the matrix units
        (never for int4 on int8-vnni: the decode rows' panels take every row, in one call)."""
        path = self.prefill_path
        min_rows = path.min_rows
        if path is PrefillPath.INT8_VNNI and self._k_quant_blocks():
            min_rows = GGUF_VNNI_MIN_ROWS
        return (
            path is not PrefillPath.FP32
            and not self._on_panels()
            and x.device.type == "cpu"
            and x.shape[0] - min(fp32_rows, x.shape[0]) >= min_rows
            and self._cpu_kernel() is not None
        )

    def silu_gated(self, x: torch.Tensor, fp32_rows: int = 0) -> torch.Tensor | None:
        """For a gate_up matrix [gate; up] without bias: silu(x gate^T) * (x up^T), float32
        [M, out/2], the prefill rows (past `fp32_rows`) computed and activated in one pass on
        the matrix units, the decode rows by the one-row kernels and `silu_mul`. None where
        this call would not use the matrix units (the caller multiplies, then activates)."""
        if (
            self.bias is not None
            or self.out_features % 32
            or not self.prefill_path.bf16
            or self.weight.kind == "gguf"  # long chunks of blocks: the float32 kernels
        ):
            return None
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not self._on_matrix_units(x2, fp32_rows):
            return None
        x2 = x2.contiguous()
        split = min(fp32_rows, x2.shape[0])
        act = torch.empty(x2.shape[0], self.out_features // 2, dtype=torch.float32)
        self._matrix_kernel(silu=True)(x2[split:], act[split:])
        if split:
            kernel = self._rows_kernel()
            assert kernel is not None
            gate_up = torch.empty(split, self.out_features, dtype=torch.float32)
            kernel(x2[:split], gate_up)
            kernels.op("silu_mul")(gate_up, act[:split])
        return act

    def __call__(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None, fp32_rows: int = 0
    ) -> torch.Tensor:
        """x [..., in] -> [..., out] in `out_dtype` (default: x's dtype). The CPU kernels sum
        in float32, so asking for float32 (logits of a bfloat16 model) skips a rounding.
        `fp32_rows`: how many leading rows (decode rows) stay on the one-row kernels."""
        out_dtype = out_dtype or x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        kernel = self._rows_kernel() if x2.device.type == "cpu" else None
        if kernel is not None:
            xf = x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            split = min(fp32_rows, xf.shape[0])
            if self._on_matrix_units(xf, split):
                self._matrix_kernel()(xf[split:], out[split:])
                if split:
                    kernel(xf[:split], out[:split])
            else:
                kernel(xf, out)
            y = out if out_dtype == torch.float32 else out.to(out_dtype)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, self.weight.dequantize().to(x.dtype), self.bias).to(out_dtype)
        return y if x.dim() == 2 else y.view(*lead, self.out_features)
