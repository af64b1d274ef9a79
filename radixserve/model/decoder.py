"""The decoder every architecture shares, over the paged KV pool: its parameters and forward
paths. What differs between Llama, Mistral, Qwen2/3, Phi-3 and Gemma 3 is data in ModelConfig
(optional q/k norms, sandwich norms, activation, windows, RoPE bases), read here; checkpoint
names and quantization live in weights.py, huge pages in hugepages.py."""

from __future__ import annotations

import logging
from enum import Enum
from typing import NamedTuple

import torch
from torch import nn

from radixserve.model import kernels
from radixserve.model.attention import AttendFn, AttentionBackend, SdpaBackend, planned
from radixserve.model.batch import ForwardBatch, narrow_to_outputs
from radixserve.model.config import ModelConfig
from radixserve.model.kv_pool import KVPool
from radixserve.model.layers import (
    Linear,
    Rotary,
    apply_rope,
    frozen,
    fused_kernels_apply,
    gate_activation,
    rms_norm,
)
from radixserve.model.quant import QuantizedWeight, QuantLinear

log = logging.getLogger(__name__)

# The fused kernels' codes of ModelConfig.hidden_act (layers.cpp's gate_act_mul).
ACT_CODES = {"silu": 0, "gelu_tanh": 1}


class ForwardPath(Enum):
    """The ways an eager step runs the decoder (`DecoderModel.forward_path` picks one; the
    runner's CUDA-graph decode steps replay `DecoderModel.decode` instead)."""

    FUSED_DECODE = "fused-decode"  # every layer in one call of our `decode_layers` kernel
    NARROWED = "narrowed"  # layer by layer; the last one's attention and MLP for output rows only
    LAYERS = "layers"  # layer by layer, every row


class Projection(NamedTuple):
    """One matmul of a step: its name, its wrapper, and the dense weight it was built from."""

    name: str  # "layers.0.qkv_lin", ..., "head_lin"
    lin: Linear | QuantLinear
    weight_name: str  # the dense weight's name in state_dict(): "layers.0.qkv", ..., "embed"
    weight: nn.Parameter


def _optional(t: torch.Tensor | None) -> torch.Tensor:
    """`t`, or the empty tensor our kernels read as "absent"."""
    return t if t is not None else torch.empty(0)


class DecoderLayer(nn.Module):
    """One pre-norm block: attention then a gated MLP, with fused QKV and gate/up weights.

    Optional parts, as the config asks: a q/k/v bias, RMSNorms over each q and k head, norms
    on the attention and MLP outputs before their residual adds (Gemma 3's sandwich), a
    sliding window and the local RoPE table (`window`, `rope_table`)."""

    qkv_lin: Linear | QuantLinear
    o_lin: Linear | QuantLinear
    gate_up_lin: Linear | QuantLinear
    down_lin: Linear | QuantLinear

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = config.layer_window(index)
        self.rope_table = 1 if config.layer_local_rope(index) else 0
        self.scale = config.softmax_scale
        self.act_name = config.hidden_act
        self.act = gate_activation(config.hidden_act)
        hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * d
        self.input_norm = frozen(torch.ones(hidden))
        self.qkv = frozen(torch.empty(qkv_rows, hidden))
        self.qkv_bias = frozen(torch.zeros(qkv_rows)) if config.attention_bias else None
        self.q_norm = frozen(torch.ones(d)) if config.qk_norm else None
        self.k_norm = frozen(torch.ones(d)) if config.qk_norm else None
        self.o = frozen(torch.empty(hidden, config.num_heads * d))
        self.attn_out_norm = frozen(torch.ones(hidden)) if config.sandwich_norms else None
        self.post_norm = frozen(torch.ones(hidden))  # before the MLP
        self.gate_up = frozen(torch.empty(2 * inter, hidden))
        self.down = frozen(torch.empty(hidden, inter))
        self.mlp_out_norm = frozen(torch.ones(hidden)) if config.sandwich_norms else None

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

    def _attend(
        self, attend: AttendFn, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
    ) -> torch.Tensor:
        return attend(q, k_blocks, v_blocks, self.window, self.scale)

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
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; writes the tokens' K/V at `slot_mapping` first. With
        `out_rows`, every row's K/V is written but only those rows go on through attention
        (whose `attend` then describes just them) and the MLP: -> [len(out_rows), hidden].
        `cos`/`sin` [T, head_dim] are this layer's RoPE table at the rows' positions."""
        if self.fused:
            return self._forward_fused(
                h, cos, sin, slot_mapping, attend, k_blocks, v_blocks, out_rows
            )
        t = h.shape[0]
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.qkv_lin(x)
        nh, nkv = self.num_heads, self.num_kv
        qk = qkv[:, : (nh + nkv) * self.head_dim].view(t, nh + nkv, -1)
        if self.q_norm is not None and self.k_norm is not None:
            heads = torch.cat([self.q_norm.expand(nh, -1), self.k_norm.expand(nkv, -1)])
            qk = rms_norm(qk, heads, self.eps)
        # Rotate q and k in one pass: they are adjacent heads of the fused projection.
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * self.head_dim :].view(t, nkv, self.head_dim)
        k_slots = k_blocks.view(-1, self.num_kv, self.head_dim)
        v_slots = v_blocks.view(-1, self.num_kv, self.head_dim)
        k_slots.index_copy_(0, slot_mapping, k.to(k_slots.dtype))  # --kv-cache-dtype
        v_slots.index_copy_(0, slot_mapping, v.to(v_slots.dtype))
        if out_rows is not None:
            q, h = q[out_rows], h[out_rows]
        o = self.o_lin(self._attend(attend, q, k_blocks, v_blocks))
        if self.attn_out_norm is not None:
            o = rms_norm(o, self.attn_out_norm, self.eps)
        h = h + o
        x = rms_norm(h, self.post_norm, self.eps)
        gate, up = self.gate_up_lin(x).chunk(2, dim=-1)
        m = self.down_lin(self.act(gate) * up)
        if self.mlp_out_norm is not None:
            m = rms_norm(m, self.mlp_out_norm, self.eps)
        return h + m

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
    ) -> torch.Tensor:
        """`forward` with the elementwise steps in radixserve's CPU kernels (float32 on CPU):
        a dozen op calls per layer instead of about fifty. Updates h in place (without
        `out_rows`)."""
        rms_norm_into = kernels.op("rms_norm")
        nh = self.num_heads
        x = torch.empty_like(h)
        rms_norm_into(h, self.input_norm, self.eps, x)
        qkv = self.qkv_lin(x).contiguous()
        kernels.op("rope_kv_write")(
            qkv, cos, sin, slot_mapping, k_blocks, v_blocks, nh,
            _optional(self.q_norm), _optional(self.k_norm), self.eps,
        )  # fmt: skip
        q = qkv[:, : nh * self.head_dim]
        if out_rows is not None:
            q, h, x = q[out_rows], h[out_rows], x[out_rows]
        t = h.shape[0]
        o = self.o_lin(self._attend(attend, q.view(t, nh, self.head_dim), k_blocks, v_blocks))
        if self.attn_out_norm is not None:
            rms_norm_into(o, self.attn_out_norm, self.eps, o)
        h += o
        rms_norm_into(h, self.post_norm, self.eps, x)
        gate_up = self.gate_up_lin(x)
        act = torch.empty(t, gate_up.shape[1] // 2, dtype=h.dtype)
        kernels.op("gate_act_mul")(gate_up, act, ACT_CODES[self.act_name])
        m = self.down_lin(act)
        if self.mlp_out_norm is not None:
            rms_norm_into(m, self.mlp_out_norm, self.eps, m)
        h += m
        return h

    def norms(self) -> list[nn.Parameter]:
        """Every RMSNorm weight of the layer, in the order a step reads them."""
        found = [self.input_norm, self.q_norm, self.k_norm, self.attn_out_norm]
        found += [self.post_norm, self.mlp_out_norm]
        return [n for n in found if n is not None]


class DecoderModel(nn.Module):
    """The decoder stack; forward returns float32 logits of the rows the batch asks for."""

    head_lin: Linear | QuantLinear
    layers: nn.ModuleList
    quantization = "none"  # the kind of codes the projections were given (weights.py)
    _decode_weights: list[torch.Tensor] | None = None  # decode_layer_weights(), once built
    _decode_weights_possible = True
    _fallback_logged = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed = frozen(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
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
        h = self._layers(batch.input_ids, batch.positions, batch.slot_mapping, kv, attend, last)
        if logits_rows.numel() == 0:
            return torch.empty(0, self.config.vocab_size, device=h.device)
        return self._logits(h[logits_rows])

    def _fused_decode(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """ForwardPath.FUSED_DECODE: every layer of a decode-only step in one kernel call."""
        d = batch.decode
        weights = self.decode_layer_weights()
        assert d is not None and weights is not None
        h = self._embed(batch.input_ids)
        cos, sin = self.rotary(batch.positions)
        c = self.config
        kernels.op("decode_layers")(
            h, weights, cos, sin, batch.slot_mapping, kv.k, kv.v,
            d.block_table, d.context_lens, self._layer_windows, self._layer_ropes,
            c.num_heads, c.rms_norm_eps, c.softmax_scale, ACT_CODES[c.hidden_act],
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

        def attend(
            q: torch.Tensor,
            k_blocks: torch.Tensor,
            v_blocks: torch.Tensor,
            window: int | None,
            scale: float,
        ) -> torch.Tensor:
            return attn.decode(q, k_blocks, v_blocks, block_table, context_lens, window, scale)

        return self._logits(self._layers(input_ids, positions, slot_mapping, kv, attend))

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv: KVPool,
        attend: AttendFn,
        last: tuple[torch.Tensor, AttendFn] | None = None,
    ) -> torch.Tensor:
        """Hidden states after every layer; with `last` = (rows, attend for them), the last
        layer's output of those rows only."""
        h = self._embed(input_ids)
        cos, sin = self.rotary(positions)
        layers = self.decoder_layers()
        for i, layer in enumerate(layers):
            k_blocks, v_blocks = kv.blocks(i)
            lc, ls = cos[layer.rope_table], sin[layer.rope_table]
            if last is not None and i == len(layers) - 1:
                rows, attend_rows = last
                out: torch.Tensor = layer(
                    h, lc, ls, slot_mapping, attend_rows, k_blocks, v_blocks, rows
                )
                return out
            h = layer(h, lc, ls, slot_mapping, attend, k_blocks, v_blocks)
        return h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of the embedding table (a new tensor), scaled where the config says so."""
        h = self.embed[input_ids]
        if self.config.embed_scale is not None:
            # As transformers' Gemma: the scale rounded to the model dtype first.
            h *= torch.tensor(self.config.embed_scale).to(h.dtype)
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
        once), or None where a decode step cannot run there (`fused_decode_unavailable` says
        why; logged once)."""
        if self._decode_weights is not None or not self._decode_weights_possible:
            return self._decode_weights
        why = self.fused_decode_unavailable()
        if why is not None:
            self._decode_weights_possible = False
            if not self._fallback_logged:
                self._fallback_logged = True
                log.info("decode steps run layer by layer, not in one kernel call: %s", why)
            return None
        named_layers: list[dict[str, torch.Tensor]] = []
        for layer in self.decoder_layers():
            # By the names of the kernels' table (kernels/layer_weights.cpp); int8 has no mins.
            named: dict[str, torch.Tensor] = {
                "input_norm": layer.input_norm,
                "qkv.bias": _optional(layer.qkv_lin.bias),
                "q_norm": _optional(layer.q_norm),
                "k_norm": _optional(layer.k_norm),
                "attn_out_norm": _optional(layer.attn_out_norm),
                "post_norm": layer.post_norm,
                "mlp_out_norm": _optional(layer.mlp_out_norm),
            }
            for attr, lin, _ in layer.projections():
                assert isinstance(lin, QuantLinear)
                w, proj = lin.weight, attr.removesuffix("_lin")  # "qkv_lin": "qkv.qs", ...
                named[f"{proj}.qs"], named[f"{proj}.scale"] = w.qs, w.scale
                named[f"{proj}.minv"] = _optional(w.minv)
                named[f"{proj}.kind"] = w.kernel_layout()
            named_layers.append(named)
        self._decode_weights = kernels.order_layer_weights(named_layers)
        layers = self.decoder_layers()
        self._layer_windows = torch.tensor([layer.window or 0 for layer in layers])
        self._layer_ropes = torch.tensor([layer.rope_table for layer in layers])
        return self._decode_weights

    def fused_decode_unavailable(self) -> str | None:
        """Why a decode step cannot run every layer in one `decode_layers` call (None when it
        can): it takes float32 CPU layers whose projections are quantized in kinds it
        computes, with no bias but the q/k/v one."""
        for i, layer in enumerate(self.decoder_layers()):
            if not layer.fused:
                return "the layers do not run our fused CPU kernels (float32 on the CPU only)"
            for attr, lin, _ in layer.projections():
                if not isinstance(lin, QuantLinear):
                    return f"layer {i}'s {attr} has dense weights (the kernel takes codes)"
                if not lin.weight.qs.is_cpu:
                    return f"layer {i}'s {attr} is not on the CPU"
                if lin.bias is not None and attr != "qkv_lin":
                    return f"layer {i}'s {attr} has a bias"
                if not kernels.decode_layers_computes(lin.weight.kind):
                    return f"layer {i}'s {attr} holds {lin.weight.kind} codes"
        return None

    def prepare(self) -> None:
        """Build the dense matmul wrappers; call after loading weights or moving the model
        (it drops quantized projections: quantize after it)."""
        self.weights_moved()
        self.quantization = "none"
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
        """What a step reads, in the order it reads it: each layer's input norm (and q/k
        norms), qkv and o projections (and the attention output's norm), post norm, gate/up
        and down projections (and the MLP output's norm); then the final norm and the LM head
        (norms as parameters, projections as their matmuls)."""
        out: list[nn.Parameter | Linear | QuantLinear] = []
        for layer in self.decoder_layers():
            qkv, o, gate_up, down = (lin for _, lin, _ in layer.projections())
            pre: list[nn.Parameter] = [layer.input_norm]
            pre += [n for n in (layer.q_norm, layer.k_norm) if n is not None]
            mid = [n for n in (layer.attn_out_norm,) if n is not None] + [layer.post_norm]
            post = [n for n in (layer.mlp_out_norm,) if n is not None]
            out += [*pre, qkv, o, *mid, gate_up, down, *post]
        return [*out, self.norm, self.head_lin]

    def weights_moved(self) -> None:
        """Forget what was built over the weights' memory (`decode_layer_weights`); call
        after replacing or moving any of them."""
        self._decode_weights, self._decode_weights_possible = None, True

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
