"""What a prefill/decode K/V handoff costs: bytes and milliseconds per prompt token.

Run: python benchmarks/pd_transfer.py [--model M] [--lengths 2000 8000 16000] [-- SERVE ARGS]
Starts a prefill worker and a decode worker (`serve --disaggregation-mode prefill|decode`),
then per prompt length (characters of Python's json/decoder.py source) and trial: the prompt
is prefilled on the prefill worker first, so that the handoff's own work there is one token;
then the decode worker is sent it with `kv_transfer_params` naming the prefill worker, and
the decode worker's `radixserve_kv_transfer_*` counters give the tokens and bytes moved and
the seconds from asking to the K/V in its tree. Prints one line per request.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import httpx

from radixserve.bench.servers import ServerProcess, radixserve_command


def counter(url: str, name: str) -> float:
    """A counter's value, summed over its labels, from `url`'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.M))


def transfer(url: str) -> tuple[float, float, float]:
    """The decode worker's (tokens, bytes, seconds) moved so far."""
    names = ("tokens", "bytes", "seconds")
    return tuple(counter(url, f"radixserve_kv_transfer_{n}_total") for n in names)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the workers' --model (default model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000, 16000])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("serve_args", nargs="*", help="more `radixserve serve` flags")
    args = parser.parse_args()
    common = [*(["--model", args.model] if args.model else []), *args.serve_args]
    common += ["--log-level", "warning"]
    text = open(json.__file__.replace("__init__.py", "decoder.py")).read()
    with (
        ServerProcess(radixserve_command(*common, "--disaggregation-mode", "prefill")) as p,
        ServerProcess(radixserve_command(*common, "--disaggregation-mode", "decode")) as d,
    ):
        for chars in args.lengths:
            for trial in range(args.trials):
                prompt = f"{chars}-{trial} " + (text * (1 + chars // len(text)))[:chars]
                one = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                httpx.post(f"{p.url}/v1/completions", json=one, timeout=600).raise_for_status()
                before = transfer(d.url)
                t0 = time.perf_counter()
                body = {**one, "kv_transfer_params": {"prefill_url": p.url}}
                r = httpx.post(f"{d.url}/v1/completions", json=body, timeout=600)
                r.raise_for_status()
                ttft = time.perf_counter() - t0
                tokens, nbytes, secs = (b - a for a, b in zip(before, transfer(d.url), strict=True))
                print(
                    f"prompt {r.json()['usage']['prompt_tokens']} tokens: {tokens:.0f} tokens "
                    f"moved, {nbytes / 1e6:.1f} MB ({nbytes / max(tokens, 1) / 1e3:.1f} KB a "
                    f"token), handoff {secs * 1e3:.0f} ms ({secs * 1e3 / max(tokens, 1):.3f} ms "
                    f"a token), request {ttft * 1e3:.0f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
