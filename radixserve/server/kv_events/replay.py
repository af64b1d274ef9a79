"""A one-shot client of a KV event replay socket (vLLM's protocol), for scripts and tests:
ask for the batches kept from a sequence number on, read them until the end marker."""

from __future__ import annotations

import zmq

from radixserve.server.kv_events.wire import END_SEQ


def request_replay(endpoint: str, start: int = 0, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """(seq, msgpack payload) of every batch the publisher at `endpoint` (its ROUTER replay
    socket) keeps from `start` on, in order. Raises TimeoutError if it stops answering."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"{endpoint} did not finish its replay within {timeout:g} s")
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 3 or frames[1] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[1], "big"), frames[2]))
    finally:
        sock.close(linger=0)
        ctx.term()
