"""What the router checks of a worker whose cache it mirrors from block events: that the
worker cuts prompts into the same tokens (its /tokenize, or the prompt_tokens it reports)
and into blocks of the size the router assumes.

A mirror built from another tokenizer's ids would never match a routed prompt, so a worker
that disagrees is a start-up error, not a silent miss.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx

from radixserve.errors import ConfigError
from radixserve.router.prompt import PromptTokenizer

log = logging.getLogger(__name__)

PROBE = [
    {"role": "system", "content": "You check tokenizers."},
    {"role": "user", "content": "Route me: caché, 東京, 42 tokens, tabs\tand  spaces."},
]


def vllm_cache_config(metrics_text: str) -> dict[str, Any]:
    """block_size and num_blocks from vLLM's `vllm:cache_config_info{...} 1` metric."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out: dict[str, Any] = {}
            for key, name in (("block_size", "block_size"), ("num_gpu_blocks", "num_blocks")):
                if labels.get(key, "").isdigit():
                    out[name] = int(labels[key])
            return out
    return {}


def worker_block_size(client: httpx.Client, url: str) -> int | None:
    """The worker's block size: radixserve's /v1/cache/stats, else vLLM's /metrics."""
    try:
        r = client.get(url + "/v1/cache/stats")
        if r.status_code == 200 and isinstance(r.json().get("block_size"), int):
            return int(r.json()["block_size"])
        r = client.get(url + "/metrics")
        if r.status_code == 200:
            bs = vllm_cache_config(r.text).get("block_size")
            return int(bs) if bs else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return None


def worker_prompt_tokens(client: httpx.Client, url: str, model: str) -> list[int] | int | None:
    """The probe chat as the worker tokenizes it: the ids from /tokenize (vLLM, SGLang), else
    only their number from a 1-token chat completion's usage; None if it answers neither."""
    body: dict[str, Any] = {"model": model, "messages": PROBE, "add_generation_prompt": True}
    try:
        r = client.post(url + "/tokenize", json=body)
        if r.status_code == 200 and isinstance(r.json().get("tokens"), list):
            return [int(t) for t in r.json()["tokens"]]
        chat = {"model": model, "messages": PROBE, "max_tokens": 1, "temperature": 0.0}
        r = client.post(url + "/v1/chat/completions", json=chat)
        if r.status_code == 200:
            return int(r.json()["usage"]["prompt_tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return None


def check_worker(
    client: httpx.Client, url: str, tokenizer: PromptTokenizer, block_size: int | None
) -> bool:
    """Raise ConfigError if the worker at `url` tokenizes the probe otherwise than
    `tokenizer`, or (with `block_size`, the router's --block-size) uses other blocks.
    Returns False, checking nothing, if the worker does not answer (it is checked by its
    events then: a BlockStored of another block size stops its mirror with an error)."""
    try:
        models = client.get(url + "/v1/models").json()["data"]
        model = str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        log.warning("worker %s did not answer /v1/models; checking it by its events", url)
        return False
    bs = worker_block_size(client, url)
    if block_size is not None and bs is not None and bs != block_size:
        raise ConfigError(
            f"worker {url} caches blocks of {bs} tokens, not --block-size {block_size}"
        )
    ours = list(tokenizer.apply_chat_template(PROBE))
    theirs = worker_prompt_tokens(client, url, model)
    if isinstance(theirs, list) and theirs != ours:
        i = next((k for k, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        where = f"first difference at token {i}" if i is not None else "one is a prefix"
        raise ConfigError(
            f"worker {url} ({model}) tokenizes prompts differently from the router's --model "
            f"({len(theirs)} vs {len(ours)} tokens, {where}); give the router the worker's model"
        )
    if isinstance(theirs, int) and theirs != len(ours):
        raise ConfigError(
            f"worker {url} ({model}) counts {theirs} prompt tokens where the router's --model "
            f"counts {len(ours)}; give the router the worker's model"
        )
    if theirs is None:
        log.warning("worker %s tokenized nothing for the router; not checked", url)
    return True
