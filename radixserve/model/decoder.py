"""The decoder every architecture shares, over the paged KV pool: the stack of DecoderLayers
(decoder_layer.py), its forward paths and the one-call decode step's weights. What differs
between Llama, Mistral, Qwen2/3, Phi-3 and Gemma 3 is data in ModelConfig (optional q/k norms,
sandwich norms, activation, windows, RoPE bases); checkpoint names and quantization live in
weights.py, huge pages in hugepages.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import Enum
from typing import NamedTuple

import torch
from torch import nn

from radixserve.model import kernels
from radixserve.model.attention import AttentionBackend, SdpaBackend, planned
from radixserve.model.batch import ForwardBatch, narrow_to_outputs
from radixserve.model.config import ModelConfig
from radixserve.model.decoder_layer import ACT_CODES, DecoderLayer, LayerArgs, optional_tensor
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.kv_pool import KVPool
from radixserve.model.layers import Linear, Rotary, frozen, fused_kernels_apply, rms_norm
from radixserve.model.quant import QuantizedWeight, QuantLinear

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class StepArgs:
    """The layers' arguments for one step: those of layers whose K/V is in the main pool
    (`main`) and in the window pool (`window`, where the step has a window view), each with
    the narrowed last layer's (`*_last`, where the step narrows to its output rows)."""

    main: LayerArgs
    window: LayerArgs | None = None
    main_last: LayerArgs | None = None
    window_last: LayerArgs | None = None

    def of(self, in_window_pool: bool, last: bool) -> LayerArgs:
        """A layer's arguments: in the window pool or not, the last layer or not."""
        if in_window_pool and self.window is not None:
            chosen, narrowed = self.window, self.window_last
        else:
            chosen, narrowed = self.main, self.main_last
        if last and self.main_last is not None:
            assert narrowed is not None  # a narrowed step narrows in both pools
            return narrowed
        return chosen


class DecoderModel(nn.Module):
    """The decoder stack; forward returns float32 logits of the rows the batch asks for."""

    head_lin: Linear | QuantLinear
    layers: nn.ModuleList
    quantization = "none"  # the kind of codes the projections were given (weights.py)
    prefill_path = PrefillPath.FP32  # where prefill chunks' matmuls run (use_prefill_path)
    # The embedding table as codes where `embed` holds no values (weights.use_stored_embedding;
    # None then: the tied LM head's codes).
    embed_codes: QuantizedWeight | None = None
    _decode_weights: list[torch.Tensor] | None = None  # decode_layer_weights(), once built
    _decode_weights_possible = True
    _fallback_logged = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, positions: int | None = None
    ) -> None:
        """`positions`: the context served (RoPE tables for positions below it; the model's
        maximum when None)."""
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
        self.rotary = Rotary(config, dtype, positions)
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
        decode_rows = batch.decode.num_seqs if batch.decode is not None else 0
        main = LayerArgs(batch.slot_mapping, planned(backend, batch), None, decode_rows)
        w = batch.window_view
        window = (
            None
            if w is None
            else replace(main, slot_mapping=w.slot_mapping, attend=planned(backend, w))
        )
        args = StepArgs(main, window)
        logits_rows = batch.logits_rows
        narrowed = narrow_to_outputs(batch) if path is ForwardPath.NARROWED else None
        if narrowed is not None:
            rows, narrow = narrowed
            logits_rows = narrow.logits_rows
            main_last = replace(main, attend=planned(backend, narrow), out_rows=rows)
            window_last = None
            if window is not None and narrow.window_view is not None:
                attend = planned(backend, narrow.window_view)
                window_last = replace(window, attend=attend, out_rows=rows)
            args = StepArgs(main, window, main_last, window_last)
        h = self._layers(batch.input_ids, batch.positions, kv, args)
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
        w = batch.window_view or batch
        assert w.decode is not None
        kernels.op("decode_layers")(
            h, weights, cos, sin, batch.slot_mapping, kv.k, kv.v,
            d.block_table, d.context_lens, self._layer_windows, self._layer_ropes,
            c.num_heads, c.rms_norm_eps, c.softmax_scale, ACT_CODES[c.hidden_act],
            kv.k_window, kv.v_window, w.slot_mapping, w.decode.block_table, kv.layer_pool_ids,
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

        args = StepArgs(LayerArgs(slot_mapping, attend))
        return self._logits(self._layers(input_ids, positions, kv, args))

    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool, args: StepArgs
    ) -> torch.Tensor:
        """Hidden states after every layer (of the last layer's `out_rows` only, where it
        has them); layers whose K/V is in the window pool (`kv.in_window_pool`) take
        `args.window`."""
        h = self._embed(input_ids)
        cos, sin = self.rotary(positions)
        layers = self.decoder_layers()
        for i, layer in enumerate(layers):
            k_blocks, v_blocks = kv.blocks(i)
            table = layer.rope_table
            layer_args = args.of(kv.in_window_pool(i), i == len(layers) - 1)
            h = layer(h, cos[table], sin[table], k_blocks, v_blocks, layer_args)
        return h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of the embedding table (a new tensor), scaled where the config says so."""
        if self.embed.numel():
            h = self.embed[input_ids]
        else:  # looked up in the codes
            codes = self.embed_codes
            if codes is None:
                assert isinstance(self.head_lin, QuantLinear)
                codes = self.head_lin.weight
            h = codes.rows(input_ids).to(self.embed.dtype)
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
                "qkv.bias": optional_tensor(layer.qkv_lin.bias),
                "q_norm": optional_tensor(layer.q_norm),
                "k_norm": optional_tensor(layer.k_norm),
                "attn_out_norm": optional_tensor(layer.attn_out_norm),
                "post_norm": layer.post_norm,
                "mlp_out_norm": optional_tensor(layer.mlp_out_norm),
            }
            for attr, lin, _ in layer.projections():
                assert isinstance(lin, QuantLinear)
                proj = attr.removesuffix("_lin")  # "qkv_lin": "qkv.qs", ...
                qs, scale, minv, layout = lin.decode_operands()
                named[f"{proj}.qs"], named[f"{proj}.scale"] = qs, scale
                named[f"{proj}.minv"], named[f"{proj}.kind"] = optional_tensor(minv), layout
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

    def use_prefill_path(self, path: PrefillPath, in_place: bool = False) -> None:
        """Run prefill chunks' layer matmuls on `path` (kernels/matrix.py) from now on: the
        quantized projections and a quantized LM head take it (the head's decode rows with
        the layers' decode kernels; int8-vnni's int4 panels written over the int4 codes with
        `in_place`). Call after quantizing; the attention backend reads `prefill_path` too
        (the runner passes it)."""
        self.prefill_path = path
        self.weights_moved()  # int8-vnni repacks int4 codes into panels
        fp32: list[str] = []  # projections whose prefill chunks stay on the float32 kernels
        for i, layer in enumerate(self.decoder_layers()):
            for attr, lin, _ in layer.projections():
                if isinstance(lin, QuantLinear):
                    lin.use_prefill_path(path, in_place)
                if path is not PrefillPath.FP32 and (
                    not isinstance(lin, QuantLinear) or lin.prefill_rows_fp32
                ):
                    fp32.append(f"layers.{i}.{attr}")
        if isinstance(self.head_lin, QuantLinear):
            self.head_lin.use_prefill_path(path, in_place)
        if fp32:
            log.info(
                "prefill on %s: %d of %d layer projections' prefill chunks stay float32 (dense, "
                "GGUF blocks as stored, or sizes the bfloat16 kernels do not take), e.g. %s",
                path.value, len(fp32), 4 * len(self.decoder_layers()), ", ".join(fp32[:3]),
            )  # fmt: skip

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
