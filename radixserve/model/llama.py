"""Llama-family decoder whose attention reads and writes the paged KV pool."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import kernels
from radixserve.model.attention import AttentionBackend, CpuPagedBackend, SdpaBackend
from radixserve.model.batch import ForwardBatch, narrow_to_outputs
from radixserve.model.config import ModelConfig
from radixserve.model.hugepages import pack_on_huge_pages
from radixserve.model.kv_pool import KVPool
from radixserve.model.quant import GROUP, QuantizedWeight, QuantLinear, quantize


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] with the config's theta and scaling."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = config.rope_scaling
    if not s:
        return inv.float()
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(s["factor"])).float()
    if kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, out).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


class Rotary(nn.Module):
    """cos/sin tables for every position up to the model's maximum, built once."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class Linear:
    """y = x W^T (+ b), with the weight prepacked for oneDNN where that is faster.

    On CPU in bfloat16, oneDNN's prepacked GEMM is ~1.7x faster than F.linear for the
    few-row matmuls of decode steps; elsewhere this is F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
                probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
                self._packed_call(probe, packed)
                self.packed = packed
            except (RuntimeError, AttributeError):
                self.packed = None

    def _packed_call(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self._packed_call(x, self.packed)
        return F.linear(x, self.weight, self.bias)


def fused_kernels_apply(weight: torch.Tensor) -> bool:
    """Whether a layer with weights like `weight` runs its elementwise steps in our CPU
    kernels (float32 on CPU, kernels built; RADIXSERVE_CPU_KERNELS=0 turns them off)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels.load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the model dtype (as transformers does).

    Normalising in float32 explicitly is also ~20x faster on CPU than bf16 F.rms_norm.
    """
    normed: torch.Tensor = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by the per-token cos/sin [T, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# Attention of a layer's queries [T, H, D] over its K/V blocks -> [T, H * D].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.input_norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(qkv_rows, config.hidden_size), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(qkv_rows), requires_grad=False)
            if config.attention_bias
            else None
        )
        self.o = nn.Parameter(
            torch.empty(config.hidden_size, config.num_heads * config.head_dim),
            requires_grad=False,
        )
        self.post_norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.gate_up = nn.Parameter(
            torch.empty(2 * config.intermediate_size, config.hidden_size), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.empty(config.hidden_size, config.intermediate_size), requires_grad=False
        )

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
        attend: Attend,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; writes the tokens' K/V at `slot_mapping` first. With
        `out_rows`, every row's K/V is written but only those rows go on through attention
        (whose `attend` then describes just them) and the MLP: -> [len(out_rows), hidden]."""
        if self.fused:
            return self._forward_fused(
                h, cos, sin, slot_mapping, attend, k_blocks, v_blocks, out_rows
            )
        t = h.shape[0]
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.qkv_lin(x)
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
        h = h + self.o_lin(attend(q, k_blocks, v_blocks))
        x = rms_norm(h, self.post_norm, self.eps)
        gate, up = self.gate_up_lin(x).chunk(2, dim=-1)
        return h + self.down_lin(F.silu(gate) * up)

    def _forward_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        attend: Attend,
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
        kernels.op("rope_kv_write")(qkv, cos, sin, slot_mapping, k_blocks, v_blocks, nh)
        q = qkv[:, : nh * self.head_dim]
        if out_rows is not None:
            q, h, x = q[out_rows], h[out_rows], x[out_rows]
        t = h.shape[0]
        h += self.o_lin(attend(q.view(t, nh, self.head_dim), k_blocks, v_blocks))
        rms_norm_into(h, self.post_norm, self.eps, x)
        gate_up = self.gate_up_lin(x)
        act = torch.empty(t, gate_up.shape[1] // 2, dtype=h.dtype)
        kernels.op("silu_mul")(gate_up, act)
        h += self.down_lin(act)
        return h


class LlamaModel(nn.Module):
    """The decoder stack; forward returns float32 logits of the rows the batch asks for."""

    head_lin: Linear | QuantLinear
    layers: nn.ModuleList
    _decode_weights: list[torch.Tensor] | None = None  # decode_layer_weights(), once built
    _decode_weights_possible = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size), requires_grad=False
            )
        )
        self.rotary = Rotary(config, dtype)
        self.to(dtype)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        backend = attn or SdpaBackend()
        d = batch.decode
        if d is not None and not batch.prefills and isinstance(backend, CpuPagedBackend):
            weights = self.decode_layer_weights()
            if weights is not None:  # every layer in one call of our kernels
                h = self.embed[batch.input_ids]
                cos, sin = self.rotary(batch.positions)
                c = self.config
                kernels.op("decode_layers")(
                    h, weights, cos, sin, batch.slot_mapping, kv.k, kv.v,
                    d.block_table, d.context_lens, c.num_heads, c.rms_norm_eps,
                )  # fmt: skip
                return self._logits(h[batch.logits_rows])
        plan = backend.plan(batch)

        def attend(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> torch.Tensor:
            return backend.forward(q, batch, plan, k_blocks, v_blocks)

        # The last layer's attention and MLP only for the rows whose output is used (a chunk
        # of 50 new tokens: 1 of them); its K/V for every row. The backends whose plan
        # depends only on the batch's description (ours on CPU).
        logits_rows = batch.logits_rows
        last = None
        if isinstance(backend, (CpuPagedBackend, SdpaBackend)):
            narrowed = narrow_to_outputs(batch)
            if narrowed is not None:
                rows, narrow = narrowed
                narrow_plan = backend.plan(narrow)

                def attend_narrow(
                    q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
                ) -> torch.Tensor:
                    return backend.forward(q, narrow, narrow_plan, k_blocks, v_blocks)

                last, logits_rows = (rows, attend_narrow), narrow.logits_rows
        h = self._layers(batch.input_ids, batch.positions, batch.slot_mapping, kv, attend, last)
        if logits_rows.numel() == 0:
            return torch.empty(0, self.config.vocab_size, device=h.device)
        return self._logits(h[logits_rows])

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
        attend: Attend,
        last: tuple[torch.Tensor, Attend] | None = None,
    ) -> torch.Tensor:
        """Hidden states after every layer; with `last` = (rows, attend for them), the last
        layer's output of those rows only."""
        h = self.embed[input_ids]
        cos, sin = self.rotary(positions)
        layers = self.decoder_layers()
        for i, layer in enumerate(layers):
            k_blocks, v_blocks = kv.blocks(i)
            if last is not None and i == len(layers) - 1:
                rows, attend_rows = last
                out: torch.Tensor = layer(
                    h, cos, sin, slot_mapping, attend_rows, k_blocks, v_blocks, rows
                )
                return out
            h = layer(h, cos, sin, slot_mapping, attend, k_blocks, v_blocks)
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
        """Build the matmul wrappers; call after loading weights or moving the model."""
        self._decode_weights, self._decode_weights_possible = None, True
        self.quantization = "none"
        self.head_lin = Linear(self.embed if self.lm_head is None else self.lm_head)
        self.fused_norm = fused_kernels_apply(self.norm)  # as each layer decides its own
        for layer in self.decoder_layers():
            layer.prepare()

    def quantize(self, kind: str, stored: dict[str, QuantizedWeight] | None = None) -> None:
        """Run every projection (and the LM head) on `kind` codes ("int8" / "int4").

        Matrices found in `stored` (transformers names, e.g. a GGUF's own Q4_1 blocks) are
        used as they are, whatever their kind; the others are quantized from the current
        weights. The dense copies of the decoder's matrices are then released. The
        embedding table stays dense for lookups.
        """
        stored = stored or {}
        device = self.embed.device

        def linear(
            names: list[str], dense: nn.Parameter, current: Linear | QuantLinear
        ) -> Linear | QuantLinear:
            if all(n in stored for n in names):
                parts = [stored[n] for n in names]
                if len({p.kind for p in parts}) == 1:
                    codes = parts[0]
                    for p in parts[1:]:
                        codes = codes.concat(p)
                    return QuantLinear(codes.to(device), current.bias)
            if dense.shape[1] % GROUP:
                return current  # groups of 32 do not tile this matrix: it stays dense
            return QuantLinear(quantize(dense, kind), current.bias)

        for i, layer in enumerate(self.decoder_layers()):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = [a + f"{x}_proj.weight" for x in ("q", "k", "v")]
            layer.qkv_lin = linear(qkv, layer.qkv, layer.qkv_lin)
            layer.o_lin = linear([a + "o_proj.weight"], layer.o, layer.o_lin)
            gate_up = [m + "gate_proj.weight", m + "up_proj.weight"]
            layer.gate_up_lin = linear(gate_up, layer.gate_up, layer.gate_up_lin)
            layer.down_lin = linear([m + "down_proj.weight"], layer.down, layer.down_lin)
            for _, lin, p in layer.projections():
                if isinstance(lin, QuantLinear):  # release the dense copy
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        head = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        head_w = self.embed if self.lm_head is None else self.lm_head
        self.head_lin = linear([head], head_w, self.head_lin)
        self.quantization = kind
        self._decode_weights, self._decode_weights_possible = None, True

    def quantized_weights(self) -> list[tuple[str, QuantizedWeight]]:
        """Each quantized matrix by name ("layers.0.qkv_lin", ..., "head_lin"): their codes
        are not parameters, so `state_dict()` does not hold them."""
        named: list[tuple[str, Linear | QuantLinear]] = [
            (f"layers.{i}.{attr}", lin)
            for i, layer in enumerate(self.decoder_layers())
            for attr, lin, _ in layer.projections()
        ]
        named.append(("head_lin", self.head_lin))
        return [(name, lin.weight) for name, lin in named if isinstance(lin, QuantLinear)]

    def pack_weights(self) -> None:
        """On CPU, move the weights a forward step reads (norms, projections or their codes,
        the LM head) into one buffer on huge pages, in the order the step reads them: the
        step then streams one run of memory instead of ~250 scattered tensors. Call after
        `quantize`; the computation is unchanged."""
        if self.embed.device.type != "cpu":
            return
        moves: list[tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], None]]] = []

        def param(p: torch.Tensor | None) -> None:
            if p is not None and p.numel():
                moves.append(([p.data], lambda new: setattr(p, "data", new[0])))

        def linear(lin: Linear | QuantLinear, dense: nn.Parameter) -> None:
            if isinstance(lin, QuantLinear):
                w = lin.weight
                parts = [w.qs, w.scale] + ([w.minv] if w.minv is not None else [])

                def use(new: list[torch.Tensor]) -> None:
                    minv = new[2] if len(new) > 2 else None
                    lin.use_weight(QuantizedWeight(w.kind, new[0], new[1], minv))

                moves.append((parts, use))
            else:
                param(dense)
            param(lin.bias)

        for layer in self.decoder_layers():
            qkv, o, gate_up, down = ((lin, dense) for _, lin, dense in layer.projections())
            param(layer.input_norm)
            linear(*qkv)
            linear(*o)
            param(layer.post_norm)
            linear(*gate_up)
            linear(*down)
        param(self.norm)
        linear(self.head_lin, self.embed if self.lm_head is None else self.lm_head)
        packed = iter(pack_on_huge_pages([t for parts, _ in moves for t in parts]))
        for parts, use in moves:
            use([next(packed) for _ in parts])
        self._decode_weights, self._decode_weights_possible = None, True

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy transformers-named weights in, fusing q/k/v and gate/up."""
        dtype = self.embed.dtype

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"weight {name} missing from the checkpoint")
            return sd[name].to(dtype)

        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                name = "lm_head.weight"
                self.lm_head.copy_(take(name) if name in sd else take("model.embed_tokens.weight"))
            for i, layer in enumerate(self.decoder_layers()):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                layer.input_norm.copy_(take(p + "input_layernorm.weight"))
                layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
                layer.qkv.copy_(torch.cat([take(a + f"{x}_proj.weight") for x in ("q", "k", "v")]))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(
                        torch.cat([take(a + f"{x}_proj.bias") for x in ("q", "k", "v")])
                    )
                layer.o.copy_(take(a + "o_proj.weight"))
                layer.gate_up.copy_(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                )
                layer.down.copy_(take(p + "mlp.down_proj.weight"))
        self.prepare()
