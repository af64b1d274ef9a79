"""Llama-family decoder whose attention reads and writes the paged KV pool: its parameters
and forward paths (checkpoint names and quantization: weights.py; huge pages: hugepages.py)."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import kernels
from radixserve.model.attention import AttendFn, AttentionBackend, SdpaBackend, planned
from radixserve.model.batch import ForwardBatch, narrow_to_outputs
from radixserve.model.config import ModelConfig
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.kv_pool import KVPool
from radixserve.model.layers import (
    Linear,
    Rotary,
    apply_rope,
    frozen,
    fused_kernels_apply,
    rms_norm,
)
from radixserve.model.quant import QuantizedWeight, QuantLinear


class ForwardPath(Enum):
    """The ways an eager step runs the decoder (`LlamaModel.forward_path` picks one; the
    runner's CUDA-graph decode steps replay `LlamaModel.decode` instead)."""

    FUSED_DECODE = "fused-decode"  # every layer in one call of our `decode_layers` kernel
    NARROWED = "narrowed"  # layer by layer; the last one's attention and MLP for output rows only
    LAYERS = "layers"  # layer by layer, every row


class Projection(NamedTuple):
    """One matmul of a step: its name, its wrapper, and the dense weight it was built from."""

    name: str  # "layers.0.qkv_lin", ..., "head_lin"
    lin: Linear | QuantLinear
    weight_name: str  # the dense weight's name in state_dict(): "layers.0.qkv", ..., "embed"
    weight: nn.Parameter


class DecoderLayer(nn.Module):
    """One pre-norm block: attention then SwiGLU MLP, with fused QKV and gate/up weights."""

    qkv_lin: Linear | QuantLinear
    o_lin: Linear | QuantLinear
    gate_up_lin: Linear | QuantLinear
    down_lin: Linear | QuantLinear

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        hidden, inter = config.hidden_size, config.intermediate_size
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.input_norm = frozen(torch.ones(hidden))
        self.qkv = frozen(torch.empty(qkv_rows, hidden))
        self.qkv_bias = frozen(torch.zeros(qkv_rows)) if config.attention_bias else None
        self.o = frozen(torch.empty(hidden, config.num_heads * config.head_dim))
        self.post_norm = frozen(torch.ones(hidden))
        self.gate_up = frozen(torch.empty(2 * inter, hidden))
        self.down = frozen(torch.empty(hidden, inter))

    def prepare(self) -> None:
        """(Re)build the matmul wrappers from the current weights."""
        self.fused = fused_kernels_apply(self.input_norm)
        self.qkv_lin = Linear(self.qkv, self.qkv_bias)
        self.o_lin = Linear(self.o)
        self.gate_up_lin = Linear(self.gate_up)
        self.down_lin = Linear(self.down)

    def projections(self) -> list[tuple[str, Linear | QuantLinear, nn.Parameter]]:
        """(attribute, matmul wrapper, dense weight) of the four projections, in the order a
        step runs them."""
        return [
            ("qkv_lin", self.qkv_lin, self.qkv),
            ("o_lin", self.o_lin, self.o),
            ("gate_up_lin", self.gate_up_lin, self.gate_up),
            ("down_lin", self.down_lin, self.down),
        ]

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        attend: AttendFn,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        out_rows: torch.Tensor | None = None,
        decode_rows: int = 0,
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; writes the tokens' K/V at `slot_mapping` first. With
        `out_rows`, every row's K/V is written but only those rows go on through attention
        (whose `attend` then describes just them) and the MLP: -> [len(out_rows), hidden].
        The first `decode_rows` rows (kept first by `out_rows`) are decode rows: their
        matmuls stay on the float32 kernels (quant.QuantLinear)."""
        if self.fused:
            return self._forward_fused(
                h, cos, sin, slot_mapping, attend, k_blocks, v_blocks, out_rows, decode_rows
            )
        t, d = h.shape[0], decode_rows
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.qkv_lin(x, fp32_rows=d)
        nh, nkv = self.num_heads, self.num_kv
        # Rotate q and k in one pass: they are adjacent heads of the fused projection.
        qk = apply_rope(qkv[:, : (nh + nkv) * self.head_dim].view(t, nh + nkv, -1), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * self.head_dim :].view(t, nkv, self.head_dim)
        k_slots = k_blocks.view(-1, self.num_kv, self.head_dim)
        v_slots = v_blocks.view(-1, self.num_kv, self.head_dim)
        k_slots.index_copy_(0, slot_mapping, k.to(k_slots.dtype))  # --kv-cache-dtype
        v_slots.index_copy_(0, slot_mapping, v.to(v_slots.dtype))
        if out_rows is not None:
            q, h = q[out_rows], h[out_rows]
        h = h + self.o_lin(attend(q, k_blocks, v_blocks), fp32_rows=d)
        x = rms_norm(h, self.post_norm, self.eps)
        gate, up = self.gate_up_lin(x, fp32_rows=d).chunk(2, dim=-1)
        return h + self.down_lin(F.silu(gate) * up, fp32_rows=d)

    def _forward_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        attend: AttendFn,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        out_rows: torch.Tensor | None = None,
        decode_rows: int = 0,
    ) -> torch.Tensor:
        """`forward` with the elementwise steps in radixserve's CPU kernels (float32 on CPU):
        a dozen op calls per layer instead of about fifty. Updates h in place (without
        `out_rows`)."""
        rms_norm_into = kernels.op("rms_norm")
        nh = self.num_heads
        x = torch.empty_like(h)
        rms_norm_into(h, self.input_norm, self.eps, x)
        qkv = self.qkv_lin(x, fp32_rows=decode_rows).contiguous()
        kernels.op("rope_kv_write")(qkv, cos, sin, slot_mapping, k_blocks, v_blocks, nh)
        q = qkv[:, : nh * self.head_dim]
        if out_rows is not None:
            q, h, x = q[out_rows], h[out_rows], x[out_rows]
        t = h.shape[0]
        d = decode_rows
        h += self.o_lin(attend(q.view(t, nh, self.head_dim), k_blocks, v_blocks), fp32_rows=d)
        rms_norm_into(h, self.post_norm, self.eps, x)
        act = None
        if isinstance(self.gate_up_lin, QuantLinear):  # on the matrix units: fused
            act = self.gate_up_lin.silu_gated(x, fp32_rows=d)
        if act is None:
            gate_up = self.gate_up_lin(x, fp32_rows=d)
            act = torch.empty(t, gate_up.shape[1] // 2, dtype=h.dtype)
            kernels.op("silu_mul")(gate_up, act)
        h += self.down_lin(act, fp32_rows=d)
        return h


class LlamaModel(nn.Module):
    """The decoder stack; forward returns float32 logits of the rows the batch asks for."""

    head_lin: Linear | QuantLinear
    layers: nn.ModuleList
    quantization = "none"  # the kind of codes the projections were given (weights.py)
    prefill_path = PrefillPath.FP32  # where prefill chunks' matmuls run (use_prefill_path)
    _decode_weights: list[torch.Tensor] | None = None  # decode_layer_weights(), once built
    _decode_weights_possible = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed = frozen(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = frozen(torch.ones(config.hidden_size))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else frozen(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.rotary = Rotary(config, dtype)
        self.to(dtype)

    def forward_path(self, batch: ForwardBatch, backend: AttentionBackend) -> ForwardPath:
        """How an eager step over `batch` runs on `backend`, as its capabilities allow:
        - FUSED_DECODE: a decode-only step whose weights our `decode_layers` kernel takes
          (quantized float32 CPU layers: `decode_layer_weights`);
        - NARROWED: a step with prefill chunks, whose rows other than each chunk's last are
          needed only for their K/V, where the backend's plan depends only on the batch's
          description (a chunk of 50 new tokens: the last layer attends 1 row, not 50);
        - LAYERS: otherwise."""
        caps = backend.capabilities
        decode_only = batch.decode is not None and not batch.prefills
        if decode_only and caps.fused_decode_step and self.decode_layer_weights() is not None:
            return ForwardPath.FUSED_DECODE
        if batch.prefills and caps.narrows_last_layer:
            return ForwardPath.NARROWED
        return ForwardPath.LAYERS

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        """Float32 logits [len(batch.logits_rows), vocab] of one step on `attn` (default:
        sdpa), by the path `forward_path` picks; writes every row's K/V into `kv`."""
        backend = attn or SdpaBackend()
        path = self.forward_path(batch, backend)
        if path is ForwardPath.FUSED_DECODE:
            return self._fused_decode(batch, kv)
        attend = planned(backend, batch)
        logits_rows, last = batch.logits_rows, None
        narrowed = narrow_to_outputs(batch) if path is ForwardPath.NARROWED else None
        if narrowed is not None:
            rows, narrow = narrowed
            last, logits_rows = (rows, planned(backend, narrow)), narrow.logits_rows
        decode_rows = batch.decode.num_seqs if batch.decode is not None else 0
        h = self._layers(
            batch.input_ids, batch.positions, batch.slot_mapping, kv, attend, last, decode_rows
        )
        if logits_rows.numel() == 0:
            return torch.empty(0, self.config.vocab_size, device=h.device)
        return self._logits(h[logits_rows])

    def _fused_decode(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """ForwardPath.FUSED_DECODE: every layer of a decode-only step in one kernel call."""
        d = batch.decode
        weights = self.decode_layer_weights()
        assert d is not None and weights is not None
        h = self.embed[batch.input_ids]
        cos, sin = self.rotary(batch.positions)
        c = self.config
        kernels.op("decode_layers")(
            h, weights, cos, sin, batch.slot_mapping, kv.k, kv.v,
            d.block_table, d.context_lens, c.num_heads, c.rms_norm_eps,
        )  # fmt: skip
        return self._logits(h[batch.logits_rows])

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        kv: KVPool,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """One new token for each of B sequences -> float32 logits [B, vocab].

        Only tensors go in, and no output shape depends on their values, so the step can be
        compiled or captured as a graph: `block_table` [B, W] int32 is any width that covers
        every context (columns past a context are not read), `context_lens` [B] int32 counts
        the new token.
        """

        def attend(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> torch.Tensor:
            return attn.decode(q, k_blocks, v_blocks, block_table, context_lens)

        return self._logits(self._layers(input_ids, positions, slot_mapping, kv, attend))

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv: KVPool,
        attend: AttendFn,
        last: tuple[torch.Tensor, AttendFn] | None = None,
        decode_rows: int = 0,
    ) -> torch.Tensor:
        """Hidden states after every layer; with `last` = (rows, attend for them), the last
        layer's output of those rows only. The first `decode_rows` rows are decode rows."""
        h = self.embed[input_ids]
        cos, sin = self.rotary(positions)
        layers = self.decoder_layers()
        for i, layer in enumerate(layers):
            k_blocks, v_blocks = kv.blocks(i)
            if last is not None and i == len(layers) - 1:
                rows, attend_rows = last
                out: torch.Tensor = layer(
                    h, cos, sin, slot_mapping, attend_rows, k_blocks, v_blocks, rows, decode_rows
                )
                return out
            h = layer(h, cos, sin, slot_mapping, attend, k_blocks, v_blocks, None, decode_rows)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.fused_norm:
            # One kernel call: after a decode step's layers have streamed the weights and K/V
            # through the caches, torch's composite rms_norm took ~250 us of cold dispatch.
            x = torch.empty_like(h)
            kernels.op("rms_norm")(h.contiguous(), self.norm, self.config.rms_norm_eps, x)
        else:
            x = rms_norm(h, self.norm, self.config.rms_norm_eps)
        if isinstance(self.head_lin, QuantLinear):
            # Our kernels' float32 sums, not rounded to a 16-bit model dtype first: at bf16's
            # resolution (0.125 at 25) close logits tie and greedy picks the lower token id.
            return self.head_lin(x, out_dtype=torch.float32)
        return self.head_lin(x).float()

    def decode_layer_weights(self) -> list[torch.Tensor] | None:
        """Every layer's weights in the order our `decode_layers` kernel takes them (built
        once), or None where a decode step cannot run there: it needs the fused float32 CPU
        layers with quantized, bias-free projections."""
        if self._decode_weights is not None or not self._decode_weights_possible:
            return self._decode_weights
        named_layers: list[dict[str, torch.Tensor]] = []
        for layer in self.decoder_layers():
            lins = [lin for _, lin, _ in layer.projections()]
            if not layer.fused or not all(
                isinstance(q, QuantLinear) and q.bias is None and q.weight.qs.is_cpu for q in lins
            ):
                self._decode_weights_possible = False
                return None
            # By the names of the kernels' table (kernels/layer_weights.cpp); int8 has no mins.
            named: dict[str, torch.Tensor] = {
                "input_norm": layer.input_norm,
                "post_norm": layer.post_norm,
            }
            for attr, lin, _ in layer.projections():
                assert isinstance(lin, QuantLinear)
                w, proj = lin.weight, attr.removesuffix("_lin")  # "qkv_lin": "qkv.qs", ...
                named[f"{proj}.qs"], named[f"{proj}.scale"] = w.qs, w.scale
                named[f"{proj}.minv"] = w.minv if w.minv is not None else torch.empty(0)
            named_layers.append(named)
        self._decode_weights = kernels.order_layer_weights(named_layers)
        return self._decode_weights

    def prepare(self) -> None:
        """Build the dense matmul wrappers; call after loading weights or moving the model
        (it drops quantized projections: quantize after it)."""
        self.weights_moved()
        self.quantization, self.prefill_path = "none", PrefillPath.FP32
        self.head_lin = Linear(self.embed if self.lm_head is None else self.lm_head)
        self.fused_norm = fused_kernels_apply(self.norm)  # as each layer decides its own
        for layer in self.decoder_layers():
            layer.prepare()

    def projections(self) -> list[Projection]:
        """Every matmul of a step, in the order a step runs them: each layer's four, then
        the LM head (whose dense weight is the embedding table when tied)."""
        weight_names = {id(p): name for name, p in self.named_parameters()}
        out = [
            Projection(f"layers.{i}.{attr}", lin, weight_names[id(weight)], weight)
            for i, layer in enumerate(self.decoder_layers())
            for attr, lin, weight in layer.projections()
        ]
        head = self.embed if self.lm_head is None else self.lm_head
        return [*out, Projection("head_lin", self.head_lin, weight_names[id(head)], head)]

    def set_projection(self, name: str, lin: Linear | QuantLinear) -> None:
        """Compute the matmul `name` (as `projections()` names it) with `lin` from now on. A
        layer's projection given codes releases its dense weight; the LM head's stays (it
        may be the embedding table)."""
        owner, _, attr = name.rpartition(".")  # "layers.3", "qkv_lin"; "", "head_lin"
        setattr(self.get_submodule(owner), attr, lin)
        weight = next(p.weight for p in self.projections() if p.name == name)
        if owner and isinstance(lin, QuantLinear):
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        self.weights_moved()

    def quantized_weights(self) -> list[tuple[str, QuantizedWeight]]:
        """Each quantized matrix by name ("layers.0.qkv_lin", ..., "head_lin"): their codes
        are not parameters, so `state_dict()` does not hold them."""
        return [
            (p.name, p.lin.weight) for p in self.projections() if isinstance(p.lin, QuantLinear)
        ]

    def step_weights(self) -> list[nn.Parameter | Linear | QuantLinear]:
        """What a step reads, in the order it reads it: each layer's input norm, qkv and o
        projections, post norm, gate/up and down projections; then the final norm and the LM
        head (norms as parameters, projections as their matmuls)."""
        out: list[nn.Parameter | Linear | QuantLinear] = []
        for layer in self.decoder_layers():
            qkv, o, gate_up, down = (lin for _, lin, _ in layer.projections())
            out += [layer.input_norm, qkv, o, layer.post_norm, gate_up, down]
        return [*out, self.norm, self.head_lin]

    def weights_moved(self) -> None:
        """Forget what was built over the weights' memory (`decode_layer_weights`); call
        after replacing or moving any of them."""
        self._decode_weights, self._decode_weights_possible = None, True

    def use_prefill_path(self, path: PrefillPath) -> None:
        """Run prefill chunks' layer matmuls on `path` (kernels/matrix.py) from now on: the
        quantized projections take it, the LM head stays on the float32 kernels. Call after
        quantizing; the attention backend reads `prefill_path` too (the runner passes it)."""
        self.prefill_path = path
        for layer in self.decoder_layers():
            for _, lin, _ in layer.projections():
                if isinstance(lin, QuantLinear):
                    lin.use_prefill_path(path)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
