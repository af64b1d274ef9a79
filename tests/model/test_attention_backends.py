"""The attention backend registry: one class per --attention-backend name, chosen by what each
class says it can do, and a package that imports without triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixserve.model import attention
from radixserve.model.attention import (
    BACKENDS,
    CpuPagedBackend,
    SdpaBackend,
    TritonPagedBackend,
    auto_backend,
    select_backend,
)
from radixserve.values import ATTENTION_BACKENDS

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_every_backend_name_but_auto_has_a_class_of_that_name() -> None:
    assert set(BACKENDS) == set(ATTENTION_BACKENDS) - {"auto"}
    for name, cls in BACKENDS.items():
        assert cls.name == name


def test_importing_the_model_and_choosing_a_cpu_backend_does_not_import_triton() -> None:
    code = (
        "import sys, torch\n"
        "import radixserve.model.attention, radixserve.model.decoder, radixserve.model.runner\n"
        "from radixserve.model.attention import select_backend\n"
        "select_backend('auto', torch.device('cpu'), torch.float32)\n"
        "select_backend('sdpa', torch.device('cpu'), torch.bfloat16)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_auto_prefers_a_backend_that_reads_the_pool_in_place() -> None:
    assert CpuPagedBackend.capabilities.reads_pool_in_place
    assert not SdpaBackend.capabilities.reads_pool_in_place
    assert auto_backend(CPU, torch.float32) == "cpu"  # our kernels build wherever tests run


def test_auto_picks_only_backends_that_serve_the_device_and_dtype(monkeypatch) -> None:
    assert auto_backend(CPU, torch.bfloat16) == "sdpa"  # cpu: float32 only; triton: CUDA only
    monkeypatch.setattr(attention.triton, "triton_unavailable", lambda device: None)
    assert auto_backend(CUDA, torch.bfloat16) == "triton"
    assert auto_backend(CPU, torch.float32) == "cpu"  # triton serves CUDA only, even when it runs


def test_auto_falls_back_to_sdpa_where_the_in_place_backend_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(CpuPagedBackend, "unavailable_reason", classmethod(lambda c, d, t: "no"))
    assert isinstance(select_backend("auto", CPU, torch.float32), SdpaBackend)
    with pytest.raises(ValueError, match="--attention-backend cpu no"):
        select_backend("cpu", CPU, torch.float32)


def test_a_pool_the_chosen_backend_cannot_read_is_an_error_naming_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(attention.triton, "triton_unavailable", lambda device: None)
    monkeypatch.setattr(TritonPagedBackend, "__init__", lambda self: None)  # no triton needed
    assert isinstance(select_backend("auto", CUDA, torch.bfloat16), TritonPagedBackend)
    for name in ("auto", "triton"):
        with pytest.raises(ValueError, match="--kv-cache-dtype float16 needs --attention-back"):
            select_backend(name, CUDA, torch.bfloat16, torch.float16)
    assert isinstance(select_backend("sdpa", CUDA, torch.bfloat16, torch.float16), SdpaBackend)


def test_capabilities_say_which_forward_paths_each_backend_allows() -> None:
    fused = {n for n, cls in BACKENDS.items() if cls.capabilities.fused_decode_step}
    narrowing = {n for n, cls in BACKENDS.items() if cls.capabilities.narrows_last_layer}
    capturable = {n for n, cls in BACKENDS.items() if cls.capabilities.graph_capturable}
    assert fused == {"cpu"}
    assert narrowing == {"cpu", "sdpa"}
    assert capturable == {"sdpa", "triton"}
