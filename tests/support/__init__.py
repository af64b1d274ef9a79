"""What the tests of every folder share besides fixtures: free ports and polling, radixserve
subprocesses (servers and one-shot commands), and tiny random Llama models.

Import from here (`from tests.support import ServerProcess, wait_for`); the conftest files
wrap these in fixtures and hold nothing else.
"""

from tests.support.engines import Collector, run_until_idle
from tests.support.models import build_tiny_pair, write_tiny_model
from tests.support.polling import free_port, wait_for
from tests.support.processes import ServerProcess, run_cli, running_server

__all__ = [
    "Collector",
    "ServerProcess",
    "build_tiny_pair",
    "free_port",
    "run_cli",
    "run_until_idle",
    "running_server",
    "wait_for",
    "write_tiny_model",
]
