"""Checkpoint weights into a DecoderModel: the Hugging Face (transformers) tensor names behind
each parameter for every architecture, loading them (q/k/v and gate/up fused where the
checkpoint holds them apart), quantizing the projections from the dense weights or from a
checkpoint's own codes (a GGUF's blocks), and packing what a step reads onto huge pages."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.decoder import DecoderModel, Projection
from radixserve.model.hugepages import PackedBuffer, WeightArena
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.layers import Linear
from radixserve.model.quant import GROUP, QuantizedWeight, QuantLinear, quantize, repacked_rows


def hf_names(config: ModelConfig) -> dict[str, list[str]]:
    """For each DecoderModel parameter (its `state_dict()` name), the transformers tensors whose
    rows it holds, in order: "layers.0.qkv" is q_proj, k_proj and v_proj of layer 0 (Phi-3's
    one qkv_proj)."""
    names = {"embed": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        ours = f"layers.{i}."
        names[ours + "input_norm"] = [p + "input_layernorm.weight"]
        if config.fused_checkpoint:
            names[ours + "qkv"] = [a + "qkv_proj.weight"]
            names[ours + "gate_up"] = [m + "gate_up_proj.weight"]
        else:
            names[ours + "qkv"] = [a + f"{x}_proj.weight" for x in ("q", "k", "v")]
            names[ours + "gate_up"] = [m + "gate_proj.weight", m + "up_proj.weight"]
        if config.attention_bias:
            names[ours + "qkv_bias"] = [a + f"{x}_proj.bias" for x in ("q", "k", "v")]
        if config.qk_norm:
            names[ours + "q_norm"] = [a + "q_norm.weight"]
            names[ours + "k_norm"] = [a + "k_norm.weight"]
        names[ours + "o"] = [a + "o_proj.weight"]
        if config.sandwich_norms:  # Gemma 3 names the norm before the MLP "pre_feedforward"
            names[ours + "attn_out_norm"] = [p + "post_attention_layernorm.weight"]
            names[ours + "post_norm"] = [p + "pre_feedforward_layernorm.weight"]
            names[ours + "mlp_out_norm"] = [p + "post_feedforward_layernorm.weight"]
        else:
            names[ours + "post_norm"] = [p + "post_attention_layernorm.weight"]
        names[ours + "down"] = [m + "down_proj.weight"]
    return names


def is_norm(name: str) -> bool:
    """Whether the DecoderModel parameter `name` is an RMSNorm weight."""
    return name == "norm" or name.endswith("_norm")


def load_hf_weights(
    model: DecoderModel,
    state_dict: Mapping[str, torch.Tensor],
    skip: frozenset[str] = frozenset(),
) -> None:
    """Copy transformers-named weights into `model` (cast to its dtype), fusing q/k/v and
    gate/up and adding the config's norm_weight_offset to every norm (Gemma's 1 + w), then
    `model.prepare()`. Parameters named in `skip` are not read: they are left empty, for
    codes to stand in for them (`coded_parameters`). A checkpoint without lm_head.weight for
    an untied head uses the embedding table. Raises KeyError naming a missing weight."""
    dtype = model.embed.dtype
    names = hf_names(model.config)
    if "lm_head" in names and names["lm_head"][0] not in state_dict:
        names["lm_head"] = names["embed"]

    def take(name: str) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"weight {name} missing from the checkpoint")
        return state_dict[name].to(dtype)

    offset = model.config.norm_weight_offset
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in skip:
                param.data = torch.empty(0, dtype=dtype)
                continue
            parts = [take(n) for n in names[name]]
            w = parts[0] if len(parts) == 1 else torch.cat(parts)
            if offset and is_norm(name):
                # In float32, as transformers' Gemma computes (1 + w) before scaling by it.
                w = (w.float() + offset).to(dtype)
            param.copy_(w)
    model.prepare()


def coded_parameters(config: ModelConfig, stored: Mapping[str, QuantizedWeight]) -> frozenset[str]:
    """The DecoderModel parameters (projections, the LM head, the embedding table) whose
    every transformers tensor `stored` holds as codes: with quantization "gguf" those compute
    (and the table is looked up) from the codes, and need no dense copy."""
    return frozenset(
        name for name, parts in hf_names(config).items() if all(p in stored for p in parts)
    )


def use_stored_embedding(model: DecoderModel, stored: Mapping[str, QuantizedWeight]) -> None:
    """Look the embedding table up in its codes (`stored`'s) once its dense values are gone:
    the LM head's own codes when the two are tied, else the table's."""
    if model.embed.numel():
        return
    head = model.head_lin
    if model.config.tie_word_embeddings and isinstance(head, QuantLinear):
        model.embed_codes = None  # the head's, as packing moves them
        return
    model.embed_codes = stored[hf_names(model.config)["embed"][0]]  # rows: any kind


def quantize_model(
    model: DecoderModel,
    kind: str,
    stored: Mapping[str, QuantizedWeight] | None = None,
    repack_k_quants: bool = True,
    arena: WeightArena | None = None,
    path: PrefillPath | None = None,
) -> None:
    """Run the projections (and the LM head) of `model` on quantized codes; sets
    `model.quantization` to `kind`.

    "gguf": every projection whose transformers tensors are all in `stored` (a GGUF's own
    blocks, model/gguf_quant.py) computes with those blocks as they are, several kinds in one
    matrix where the file mixed them (ones wholly of Q8_0 / Q5_0, or of Q4_0 / Q4_1 / Q4_K, as
    the int8 / int4 repacking of the same values: `repacked`, Q4_K only with
    `repack_k_quants`); the others keep their dense weights. With an `arena`, the codes
    from `stored` are written into it; on a `path` that holds them as panels, Q4_K and Q6_K
    blocks are written straight into its panels (`quant.repacked_rows`).
    "int4" / "int8": stored codes are used where they are that kind (or int8, as precise),
    the rest is quantized from the current dense weights, except matrices that groups of 32
    do not tile, which stay dense.
    The decoder's dense copies of quantized projections are then released (the embedding
    table stays dense for lookups).
    """
    stored = stored or {}
    names = hf_names(model.config)
    device = model.embed.device
    for projection in model.projections():
        codes = _stored_codes(names[projection.weight_name], stored, repack_k_quants, arena, path)
        # int4-vnni: int4's values, in panels
        if (
            codes is not None
            and kind != "gguf"
            and codes.kind.removesuffix("-vnni") not in (kind, "int8")
        ):
            codes = None
        if kind == "gguf" and codes is None:
            continue
        model.set_projection(projection.name, _quantized(projection, kind, codes, device))
    model.quantization = kind


def _stored_codes(
    names: list[str],
    stored: Mapping[str, QuantizedWeight],
    k_quants: bool = True,
    arena: WeightArena | None = None,
    path: PrefillPath | None = None,
) -> QuantizedWeight | None:
    """The rows of `names` concatenated from `stored` (GGUF blocks of any kinds, or int4 /
    int8 codes of one kind), repacked where that is the same values; None unless all are
    there."""
    if not all(n in stored for n in names):
        return None
    parts = [stored[n] for n in names]
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        return None
    if arena is None:
        return repacked_rows(parts, k_quants, path=path)
    return repacked_rows(parts, k_quants, arena.empty, path)


def _quantized(
    projection: Projection,
    kind: str,
    codes: QuantizedWeight | None,
    device: torch.device,
) -> Linear | QuantLinear:
    """The matmul `projection` runs as: on `codes` when given, else on its dense weight
    quantized to `kind`, else (width not a multiple of 32) as it is."""
    current = projection.lin
    if codes is not None:
        return QuantLinear(codes.to(device), current.bias)
    if projection.weight.shape[1] % GROUP:
        return current
    return QuantLinear(quantize(projection.weight, kind), current.bias)


def pack_model_weights(model: DecoderModel, arena: WeightArena | None = None) -> None:
    """On CPU, move the weights a forward step reads (`model.step_weights()`: norms,
    projections or their codes, the LM head) into one buffer on huge pages, in the order the
    step reads them: the step then streams one run of memory instead of ~250 scattered
    tensors. Tensors already in `arena` (written there in that order) stay. Call after
    quantizing; the computation is unchanged."""
    if model.embed.device.type != "cpu":
        return
    # (the tensors now, how to use their copies), read again at copy time: holding the
    # tensors here would keep every source alive until the end, two copies of the weights.
    moves: list[tuple[Callable[[], list[torch.Tensor]], Callable[[list[torch.Tensor]], None]]]
    moves = []

    def tensor(t: torch.Tensor | None) -> None:
        if t is not None and t.numel() and not (arena and arena.holds(t)):
            moves.append((lambda: [t.data], lambda new: setattr(t, "data", new[0])))

    def codes(lin: QuantLinear) -> None:
        if arena and all(arena.holds(t) for t in lin.weight.tensors()):
            return
        moves.append(
            (lambda: lin.weight.tensors(), lambda new: lin.use_weight(lin.weight.with_tensors(new)))
        )

    for read in model.step_weights():
        if isinstance(read, torch.Tensor):  # a norm
            tensor(read)
            continue
        if isinstance(read, QuantLinear):
            codes(read)
        else:
            tensor(read.weight)  # the dense parameter itself
        tensor(read.bias)
    buffer = PackedBuffer([(t.shape, t.dtype) for current, _ in moves for t in current()])
    for current, use in moves:
        use([buffer.place(t) for t in current()])
    model.weights_moved()
