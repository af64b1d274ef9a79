"""Fuzz a radixserve server from its own OpenAPI document with schemathesis (dev extra).

Each generated request, valid or not by the document, must get: no 5xx, a status and content
type the document lists, a body matching the documented response schema, and a 4xx when the
body violates the request schema. `positive_data_acceptance` is left out: no schema can say
that prompt + max_tokens must fit the context, so schema-valid requests may rightly get
400 context_length_exceeded. The stateful phase is off: the API has no resources to link.

    python benchmarks/fuzz.py                                  # tiny budget, the default model
    python benchmarks/fuzz.py --max-examples 500 --serve-args "--model DIR --default-max-tokens 8"
    python benchmarks/fuzz.py --url http://127.0.0.1:8000      # a running server
Exit status is schemathesis's: 0 when nothing was found.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from radixserve.bench.servers import ServerProcess, radixserve_command

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,negative_data_rejection"
)
DEFAULT_SERVE = "--dtype float32 --max-model-len 1024 --kv-cache-memory 128MiB"
# An endless server-sent event stream: one request never ends.
ENDLESS = "/v1/cache/events"


def fuzz_command(url: str, max_examples: int, phases: str, seed: int | None) -> list[str]:
    """The `schemathesis run` command line for the server at `url`."""
    exe = shutil.which("schemathesis")
    argv = [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]
    argv += [
        "run",
        f"{url}/openapi.json",
        "--checks",
        CHECKS,
        "--exclude-path",
        ENDLESS,
        "--phases",
        phases,
        "--max-examples",
        str(max_examples),
        "--workers",
        "1",
        "--request-timeout",
        "300",
        "--suppress-health-check",
        "too_slow",  # the message schema is large; a busy CPU makes generation look slow
        "--no-color",
    ]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return argv


def main(argv: list[str] | None = None) -> int:
    """Start a server unless --url is given, run schemathesis against it, return its status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="fuzz this server instead of starting one")
    p.add_argument("--serve-args", default=DEFAULT_SERVE, help="options of the started server")
    p.add_argument("--max-examples", type=int, default=200, help="per operation and phase")
    p.add_argument("--phases", default="examples,coverage,fuzzing")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    if args.url:
        cmd = fuzz_command(args.url.rstrip("/"), args.max_examples, args.phases, args.seed)
        return subprocess.call(cmd)
    with ServerProcess(radixserve_command(*args.serve_args.split())) as server:
        cmd = fuzz_command(server.url, args.max_examples, args.phases, args.seed)
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
