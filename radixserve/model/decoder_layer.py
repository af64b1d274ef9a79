"""One decoder layer of every architecture: attention over the paged pool then a gated MLP,
with the optional parts ModelConfig asks for; torch ops, or our fused CPU kernels for the
elementwise steps (float32 on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixserve.model import kernels
from radixserve.model.attention import AttendFn
from radixserve.model.config import ModelConfig
from radixserve.model.layers import (
    Linear,
    apply_rope,
    frozen,
    fused_kernels_apply,
    gate_activation,
    rms_norm,
)
from radixserve.model.quant import QuantLinear

# The fused kernels' codes of ModelConfig.hidden_act (layers.cpp's gate_act_mul).
ACT_CODES = {"silu": 0, "gelu_tanh": 1}


@dataclass(frozen=True)
class LayerArgs:
    """What a layer reads of its step besides the hidden states, its RoPE table and its
    pool's blocks: where each row's K/V is written, how the rows that go on attend, which
    rows go on (None: every row), and how many leading rows are decode rows (kept first by
    `out_rows`; their matmuls stay on the float32 kernels, the rest may run on the matrix
    units)."""

    slot_mapping: torch.Tensor
    attend: AttendFn
    out_rows: torch.Tensor | None = None
    decode_rows: int = 0


def optional_tensor(t: torch.Tensor | None) -> torch.Tensor:
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
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        args: LayerArgs,
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; writes the tokens' K/V at `args.slot_mapping` first.
        With `args.out_rows`, every row's K/V is written but only those rows go on through
        attention (whose `args.attend` then describes just them) and the MLP: ->
        [len(out_rows), hidden]. `cos`/`sin` [T, head_dim] are this layer's RoPE table at the
        rows' positions."""
        if self.fused:
            return self._forward_fused(h, cos, sin, k_blocks, v_blocks, args)
        t, d = h.shape[0], args.decode_rows
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.qkv_lin(x, fp32_rows=d)
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
        k_slots.index_copy_(0, args.slot_mapping, k.to(k_slots.dtype))  # --kv-cache-dtype
        v_slots.index_copy_(0, args.slot_mapping, v.to(v_slots.dtype))
        if args.out_rows is not None:
            q, h = q[args.out_rows], h[args.out_rows]
        o = self.o_lin(self._attend(args.attend, q, k_blocks, v_blocks), fp32_rows=d)
        if self.attn_out_norm is not None:
            o = rms_norm(o, self.attn_out_norm, self.eps)
        h = h + o
        x = rms_norm(h, self.post_norm, self.eps)
        gate, up = self.gate_up_lin(x, fp32_rows=d).chunk(2, dim=-1)
        m = self.down_lin(self.act(gate) * up, fp32_rows=d)
        if self.mlp_out_norm is not None:
            m = rms_norm(m, self.mlp_out_norm, self.eps)
        return h + m

    def _forward_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        args: LayerArgs,
    ) -> torch.Tensor:
        """`forward` with the elementwise steps in radixserve's CPU kernels (float32 on CPU):
        a dozen op calls per layer instead of about fifty. Updates h in place (without
        `args.out_rows`)."""
        rms_norm_into = kernels.op("rms_norm")
        nh = self.num_heads
        x = torch.empty_like(h)
        rms_norm_into(h, self.input_norm, self.eps, x)
        d, out_rows = args.decode_rows, args.out_rows
        qkv = self.qkv_lin(x, fp32_rows=d).contiguous()
        kernels.op("rope_kv_write")(
            qkv, cos, sin, args.slot_mapping, k_blocks, v_blocks, nh,
            optional_tensor(self.q_norm), optional_tensor(self.k_norm), self.eps,
        )  # fmt: skip
        q = qkv[:, : nh * self.head_dim]
        if out_rows is not None:
            q, h, x = q[out_rows], h[out_rows], x[out_rows]
        t = h.shape[0]
        attn = self._attend(args.attend, q.view(t, nh, self.head_dim), k_blocks, v_blocks)
        o = self.o_lin(attn, fp32_rows=d)
        if self.attn_out_norm is not None:
            rms_norm_into(o, self.attn_out_norm, self.eps, o)
        h += o
        rms_norm_into(h, self.post_norm, self.eps, x)
        act = None
        if self.act_name == "silu" and isinstance(self.gate_up_lin, QuantLinear):
            act = self.gate_up_lin.silu_gated(x, fp32_rows=d)  # fused on the matrix units
        if act is None:
            gate_up = self.gate_up_lin(x, fp32_rows=d)
            act = torch.empty(t, gate_up.shape[1] // 2, dtype=h.dtype)
            kernels.op("gate_act_mul")(gate_up, act, ACT_CODES[self.act_name])
        m = self.down_lin(act, fp32_rows=d)
        if self.mlp_out_norm is not None:
            rms_norm_into(m, self.mlp_out_norm, self.eps, m)
        h += m
        return h

    def norms(self) -> list[nn.Parameter]:
        """Every RMSNorm weight of the layer, in the order a step reads them."""
        found = [self.input_norm, self.q_norm, self.k_norm, self.attn_out_norm]
        found += [self.post_norm, self.mlp_out_norm]
        return [n for n in found if n is not None]
