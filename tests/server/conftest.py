"""Real `radixserve serve` subprocesses on free ports of 127.0.0.1, for the server tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from tests.support import ServerProcess, running_server

# Small and fast: float32 on CPU, a short context and a small KV pool; later options win.
BASE_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "128MiB")


@pytest.fixture(scope="session")
def launch() -> Callable[..., AbstractContextManager[ServerProcess]]:
    """`launch(*serve_options)`: a context manager running a ready server (the default model
    unless `--model` is given), stopped with SIGTERM on exit."""

    def start(*args: str) -> AbstractContextManager[ServerProcess]:
        return running_server(*BASE_ARGS, "--log-level", "info", *args)

    return start


@pytest.fixture(scope="session")
def block_size() -> int:
    """The KV block size the test servers use (the default)."""
    return 16


@pytest.fixture(scope="session")
def default_server(
    launch: Callable[..., AbstractContextManager[ServerProcess]],
) -> Iterator[ServerProcess]:
    """A server with the default options, shared by the modules that need nothing else."""
    with launch() as server:
        yield server
