"""The GGUF header reader gives what gguf's own GGUFReader gives (every metadata value, every
tensor's dims, type, offset and size), and refuses files that are not whole GGUFs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from radixserve.model.gguf_header import read_gguf_header

gguf = pytest.importorskip("gguf")


def _write(path: Path) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_rope_freq_base(5e5)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_chat_template("{{ messages[0]['content'] }} é")
    writer.add_token_list(["<unk>", "<s>", "é", "w3"])
    writer.add_token_scores([0.0, -1.5, -2.0, -3.25])
    writer.add_token_types([2, 3, 1, 1])
    writer.add_uint64("test.big", 2**40 + 3)
    writer.add_bool("test.flag", True)
    writer.add_array("test.ints", [-1, 5, 7])
    writer.add_tensor("token_embd.weight", rng.standard_normal((4, 64), dtype=np.float32))
    for kind in ("Q4_0", "Q5_0", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[kind]
        w = rng.standard_normal((3, 64)).astype(np.float32)
        writer.add_tensor(f"blk.0.{kind}.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_equals_gguf_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    header, reader = read_gguf_header(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata == fields
    assert header.metadata["tokenizer.ggml.tokens"][2] == "é"
    assert header.metadata["test.big"] == 2**40 + 3
    want = [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset),
         int(t.n_bytes))
        for t in reader.tensors
    ]  # fmt: skip
    assert [tuple(t) for t in header.tensors] == want


def test_a_file_cut_inside_its_tensors_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="ends at byte"):
        read_gguf_header(path)


@pytest.mark.parametrize("cut", [0, 3, 30, 200])
def test_a_file_cut_inside_its_header_is_refused(tmp_path: Path, cut: int) -> None:
    path = _write(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:cut] if cut else b"")
    with pytest.raises((ValueError, OSError)):
        read_gguf_header(path)


def test_another_format_or_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        read_gguf_header(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(60))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf_header(path)
