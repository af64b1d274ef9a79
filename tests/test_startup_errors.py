"""Every start-up misconfiguration of the real CLI ends in one stderr line and a non-zero exit.

Each case runs `python -m radixserve.cli ...` in its own session and checks the exit status,
that stderr's last line is `radixserve CMD: error: ...` naming the problem and is its only
error line, that no traceback was printed, and that nothing of the session is left running.
The model cases use a tiny random Llama directory written by the test, so no weights load.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from radixserve import __version__
from tests.support import free_port, run_cli, write_tiny_model

pytestmark = pytest.mark.slow  # each case starts the CLI in a subprocess (about 2 s each)


def assert_one_error_line(res: subprocess.CompletedProcess[str], command: str, *names: str) -> str:
    """The error line, after checking exit 2, no traceback and that it names every `names`."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]], res.stderr
    assert lines[-1].startswith(f"radixserve {command}: error: "), res.stderr
    for name in names:
        assert name in lines[-1], (name, lines[-1])
    return lines[-1]


@pytest.fixture(scope="module")
def word_level_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete Hugging Face directory: tiny random Llama weights (2 layers, 2 KV heads x 16
    dims, 256 positions), config and a word-level tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_version_prints_the_package_version() -> None:
    res = run_cli("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"radixserve {__version__}"


def test_cuda_that_is_not_there_is_named() -> None:
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    line = assert_one_error_line(run_cli("serve", "--device", device), "serve", "--device")
    assert "CUDA" in line and "cpu" in line


def test_unknown_device_is_named() -> None:
    assert_one_error_line(run_cli("generate", "hi", "--device", "tpu"), "generate", "'tpu'")


@pytest.mark.parametrize("size", ["banana", "0"])
def test_unparsable_kv_cache_memory_is_named(size: str) -> None:
    res = run_cli("serve", f"--kv-cache-memory={size}")
    assert_one_error_line(res, "serve", "--kv-cache-memory", size)


def test_kv_pool_larger_than_free_memory_says_what_is_free_and_fits(
    word_level_model_dir: Path,
) -> None:
    res = run_cli("serve", "--model", str(word_level_model_dir), "--kv-cache-memory", "100TiB")
    line = assert_one_error_line(res, "serve", "100TiB", "memory is free")
    assert "lower --kv-cache-memory to" in line


def test_kv_pool_too_small_for_one_request_of_max_model_len(word_level_model_dir: Path) -> None:
    args = ("serve", "--model", str(word_level_model_dir), "--kv-cache-memory", "4KiB")
    res = run_cli(*args, "--max-model-len", "256", "--dtype", "float32")
    line = assert_one_error_line(res, "serve", "--max-model-len 256", "16 tokens")
    assert "raise --kv-cache-memory to" in line


def test_a_16_bit_kv_cache_dtype_doubles_the_tokens_the_pool_holds(
    word_level_model_dir: Path,
) -> None:
    # 8 KiB: one 16-token block of this model's float32 K/V, two in float16.
    args = ("serve", "--model", str(word_level_model_dir), "--kv-cache-memory", "8KiB")
    res = run_cli(*args, "--max-model-len", "256", "--dtype", "float32", "--kv-cache-dtype", "fp16")
    assert_one_error_line(res, "serve", "--max-model-len 256", "32 tokens (2 blocks x 16)")


@pytest.mark.parametrize("value", ["fp8", "int8"])
def test_unknown_kv_cache_dtype_is_named(value: str) -> None:
    res = run_cli("serve", "--kv-cache-dtype", value)
    assert_one_error_line(res, "serve", "--kv-cache-dtype", value)


def test_max_model_len_beyond_the_models_context(word_level_model_dir: Path) -> None:
    res = run_cli("serve", "--model", str(word_level_model_dir), "--max-model-len", "100000")
    assert_one_error_line(res, "serve", "--max-model-len 100000", "256")


@pytest.mark.parametrize("size", ["0", "512"])
def test_block_size_out_of_range(size: str) -> None:
    assert_one_error_line(run_cli("serve", "--block-size", size), "serve", "--block-size")


def test_model_dir_missing_files_names_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    res = run_cli("generate", "hi", "--model", str(tmp_path))
    assert_one_error_line(res, "generate", str(tmp_path), "tokenizer.json", "safetensors")


def test_model_dir_with_missing_shards_names_them(
    word_level_model_dir: Path, tmp_path: Path
) -> None:
    for f in word_level_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    shards = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(shards))
    res = run_cli("serve", "--model", str(tmp_path))
    assert_one_error_line(res, "serve", "model-00001-of-00002.safetensors")


def test_gguf_of_another_architecture_is_named(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    env = {"RADIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    res = run_cli("chat", "hi", "--model", str(path), env=env)
    assert_one_error_line(res, "chat", "'gpt2'", "tiny-gpt2.gguf")
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]


def test_truncated_gguf_is_named(tmp_path: Path) -> None:
    """A download cut short: the reader fails on the file, the CLI says so in one line."""
    import gguf
    import numpy as np

    path = tmp_path / "cut.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    env = {"RADIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    res = run_cli("chat", "hi", "--model", str(path), env=env)
    assert_one_error_line(res, "chat", "cut.gguf", "not a readable GGUF file")


def test_model_larger_than_free_memory_is_named(word_level_model_dir: Path, tmp_path: Path) -> None:
    """Checked from the config before any weight is read: a 900B-weight model here."""
    big = tmp_path / "big"
    big.mkdir()
    for f in word_level_model_dir.iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    config = json.loads((word_level_model_dir / "config.json").read_text())
    config |= dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=1000,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=128)  # fmt: skip
    (big / "config.json").write_text(json.dumps(config))
    res = run_cli("serve", "--model", str(big), "--dtype", "float32")
    line = assert_one_error_line(res, "serve", "weights in float32", "is free")
    assert "to load" in line


def test_busy_port_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_cli("serve", "--port", str(port))
    assert_one_error_line(res, "serve", f"127.0.0.1:{port}", "in use")


def test_kv_events_config_with_an_unknown_key_is_named() -> None:
    config = '{"enable_kv_cache_events": true, "endpiont": "tcp://*:5557"}'
    res = run_cli("serve", "--kv-events-config", config)
    assert_one_error_line(res, "serve", "--kv-events-config", "endpiont")


def test_kv_events_endpoint_in_use_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})
        res = run_cli("serve", "--port", str(free_port()), "--kv-events-config", config)
    assert_one_error_line(res, "serve", "--kv-events-config", f"tcp://127.0.0.1:{port}", "in use")


def test_route_kv_events_not_one_per_worker_is_named() -> None:
    res = run_cli(
        "route", "--worker", "http://127.0.0.1:11792", "--worker", "http://127.0.0.1:11793",
        "--worker-kv-events", "tcp://127.0.0.1:5557",
    )  # fmt: skip
    assert_one_error_line(res, "route", "--worker-kv-events", "one per worker")


def test_zero_workers_is_named() -> None:
    assert_one_error_line(run_cli("serve", "--workers", "0"), "serve", "--workers")


def test_route_without_workers_is_named() -> None:
    assert_one_error_line(run_cli("route"), "route", "--worker")


def test_route_to_its_own_address_is_named() -> None:
    res = run_cli("route", "--worker", "http://127.0.0.1:11790", "--port", "11790")
    assert_one_error_line(res, "route", "http://127.0.0.1:11790", "own address")


def test_route_worker_that_is_not_a_url_is_named() -> None:
    res = run_cli("route", "--worker", "localhost")
    assert_one_error_line(res, "route", "'localhost'")


def test_route_pd_disaggregation_without_both_kinds_of_worker_is_named() -> None:
    res = run_cli("route", "--pd-disaggregation", "--prefill", "http://127.0.0.1:11794")
    assert_one_error_line(res, "route", "--pd-disaggregation", "--decode")
    res = run_cli(
        "route", "--prefill", "http://127.0.0.1:11794", "--decode", "http://127.0.0.1:11795"
    )
    assert_one_error_line(res, "route", "--prefill / --decode", "--pd-disaggregation")
    res = run_cli(
        "route", "--pd-disaggregation", "--prefill", "http://127.0.0.1:11796",
        "--decode", "http://127.0.0.1:11796",
    )  # fmt: skip
    assert_one_error_line(res, "route", "--decode http://127.0.0.1:11796", "twice")


def test_serve_pd_that_is_not_p_colon_d_or_with_workers_is_named() -> None:
    assert_one_error_line(run_cli("serve", "--pd", "2"), "serve", "--pd", "P:D")
    assert_one_error_line(run_cli("serve", "--pd", "1:0"), "serve", "--pd", "P:D")
    res = run_cli("serve", "--pd", "1:1", "--workers", "2")
    assert_one_error_line(res, "serve", "--pd", "--workers")


def test_route_threshold_out_of_range_is_named() -> None:
    res = run_cli("route", "--worker", "http://127.0.0.1:11791", "--cache-threshold", "2")
    assert_one_error_line(res, "route", "--cache-threshold")


def test_bench_concurrency_zero_is_named() -> None:
    assert_one_error_line(run_cli("bench", "--concurrency", "0"), "bench", "--concurrency")


def test_analyze_block_size_out_of_range_is_named(tmp_path: Path) -> None:
    res = run_cli("analyze", str(tmp_path / "t.jsonl"), "--block-size", "0")
    assert_one_error_line(res, "analyze", "--block-size")


def test_a_malformed_speculative_config_is_named() -> None:
    line = assert_one_error_line(
        run_cli("serve", "--speculative-config", '{"method": "eagle"}'),
        "serve",
        "--speculative-config",
    )
    assert "ngram, suffix, radix" in line


def test_the_window_pool_holds_a_request_the_one_pool_cannot(tmp_path: Path) -> None:
    # Tiny Gemma 3: 2 sliding-window layers and 1 global, 2 K/V heads x 16 in float32: a
    # 16-token block is 12 KiB in one pool, 4 KiB + half a window slot's 8 KiB with a window
    # pool. 180 KiB: 15 blocks (240 tokens) in one pool, 22 blocks (352 tokens) + 11 slots.
    model = write_tiny_model(tmp_path / "gemma", arch="gemma3", vocab_size=64)
    args = ("generate", "w1 w2", "--model", str(model), "--kv-cache-memory", "180KiB")
    args += ("--max-model-len", "256", "--dtype", "float32", "--max-num-batched-tokens", "16")
    res = run_cli(*args, "--disable-hybrid-swa-memory")
    assert_one_error_line(res, "generate", "--max-model-len 256", "240 tokens")
    res = run_cli(*args, "--max-tokens", "4")
    assert res.returncode == 0, res.stderr
