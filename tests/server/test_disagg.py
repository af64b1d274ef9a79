"""server/disagg.py's pieces that need no model: which transport a decode worker asks for, and
what it accepts as a shm handoff."""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from radixserve.engine.params import SamplingParams
from radixserve.server import disagg
from radixserve.server.disagg import DecodeRole, can_hand_off, sampling_fields


class _Pool:
    k = torch.zeros(2, 3, 4, 5, 6)
    window_slots = None


class _Engine:
    """What DecodeRole reads from an engine at construction: its pool's layout."""

    kv_pool = _Pool()


def role(backend: str) -> DecodeRole:
    return DecodeRole(_Engine(), CollectorRegistry(), backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("backend", "url", "want"),
    [
        ("auto", "http://127.0.0.1:8001", "shm"),
        ("auto", "http://localhost:8001", "shm"),
        ("auto", "http://[::1]:8001", "shm"),
        ("auto", "http://10.0.0.7:8001", "http"),
        ("auto", "http://prefill.internal:8001", "http"),
        ("http", "http://127.0.0.1:8001", "http"),
        ("shm", "http://10.0.0.7:8001", "shm"),
    ],
)
def test_the_transport_asked_for(backend: str, url: str, want: str) -> None:
    if want == "shm" and backend == "auto" and not disagg.SHM_DIR.is_dir():
        want = "http"
    assert role(backend)._transfer(url) == want


def test_a_shm_answer_naming_a_file_elsewhere_is_refused(tmp_path) -> None:
    outside = tmp_path / "radixserve-pd-x"
    outside.write_bytes(b"RADIXSERVE-PD-1\n")
    r = httpx.Response(200, json={"shm": str(outside)})
    with pytest.raises(ValueError, match="not a handoff file"):
        role("shm")._read(r)
    assert outside.exists()  # nothing outside /dev/shm is removed either


def test_what_a_prefill_worker_is_sent_of_the_sampling() -> None:
    p = SamplingParams(max_tokens=50, temperature=0.7, seed=3, min_tokens=5, logit_bias={7: 2.0})
    fields = sampling_fields(p)
    assert "max_tokens" not in fields and "n" not in fields and "structured" not in fields
    assert fields["min_tokens"] == 1 and fields["logit_bias"] == {"7": 2.0}
    assert fields["seed"] == 3 and fields["temperature"] == 0.7
    assert can_hand_off(p)
    assert not can_hand_off(SamplingParams(n=2)) and not can_hand_off(
        SamplingParams(prompt_logprobs=1)
    )


def test_shm_files_of_prefill_workers_no_longer_running_are_swept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disagg, "SHM_DIR", tmp_path)
    dead = tmp_path / "radixserve-pd-999999999-abc"  # no such pid
    mine = tmp_path / f"radixserve-pd-{os.getpid()}-abc"
    other = tmp_path / "something-else"
    for p in (dead, mine, other):
        p.write_bytes(b"x")
    disagg._sweep_shm()
    assert not dead.exists() and mine.exists() and other.exists()
