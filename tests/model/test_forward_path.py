"""Which way a step runs (DecoderModel.forward_path), decided by the batch and the backend's
capabilities, and the narrowed last layer computing what the plain layers compute."""

from __future__ import annotations

import dataclasses

import torch

from radixserve.model.attention import CpuPagedBackend, SdpaBackend, TritonPagedBackend
from radixserve.model.batch import SeqChunk, build_batch
from radixserve.model.decoder import ForwardPath
from radixserve.model.kv_pool import KVPool
from radixserve.model.weights import quantize_model

DECODE = [SeqChunk([3], 9, [0, 1, 2]), SeqChunk([4], 5, [3, 4])]
MIXED = [SeqChunk([3], 9, [0, 1, 2]), SeqChunk([5, 6, 7, 8, 9], 0, [5, 6])]


class NoNarrowingSdpa(SdpaBackend):
    """SDPA that claims its plan depends on more than the batch's description."""

    capabilities = dataclasses.replace(SdpaBackend.capabilities, narrows_last_layer=False)


def test_a_decode_step_of_a_quantized_cpu_model_is_one_kernel_call(tiny_pair_factory) -> None:
    _, model = tiny_pair_factory(intermediate_size=128)
    quantize_model(model, "int4")
    decode = build_batch(DECODE, 4)
    assert model.forward_path(decode, CpuPagedBackend()) is ForwardPath.FUSED_DECODE
    assert model.forward_path(decode, SdpaBackend()) is ForwardPath.LAYERS  # not fused_decode
    assert model.forward_path(build_batch(MIXED, 4), CpuPagedBackend()) is ForwardPath.NARROWED


def test_dense_weights_decode_layer_by_layer(tiny_pair) -> None:
    _, model = tiny_pair
    assert model.forward_path(build_batch(DECODE, 4), CpuPagedBackend()) is ForwardPath.LAYERS


def test_steps_with_prefill_narrow_only_where_the_backend_allows(tiny_pair) -> None:
    _, model = tiny_pair
    mixed = build_batch(MIXED, 4)
    assert model.forward_path(mixed, SdpaBackend()) is ForwardPath.NARROWED
    assert model.forward_path(mixed, NoNarrowingSdpa()) is ForwardPath.LAYERS
    triton_like = NoNarrowingSdpa()
    triton_like.capabilities = TritonPagedBackend.capabilities
    assert model.forward_path(mixed, triton_like) is ForwardPath.LAYERS


def test_the_narrowed_last_layer_gives_the_plain_layers_logits_and_kv(tiny_pair) -> None:
    _, model = tiny_pair
    outs = []
    for backend in (SdpaBackend(), NoNarrowingSdpa()):
        pool = KVPool(model.config, 8, 4, torch.float32)
        first = model(build_batch([SeqChunk(list(range(10, 19)), 0, [0, 1, 2])], 4), pool, backend)
        mixed = model(build_batch(MIXED, 4), pool, backend)
        outs.append((first, mixed, pool.k.clone(), pool.v.clone()))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
