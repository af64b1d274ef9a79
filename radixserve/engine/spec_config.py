"""`--speculative-config`: what drafts tokens for speculative decoding, in vLLM's key names.

A JSON object, e.g. `{"method": "radix", "num_speculative_tokens": 5}`. No draft model: the
methods draft from text already seen (see radixserve.engine.speculative):
- `ngram`: prompt lookup, the request's own prompt and output (vLLM's `ngram`);
- `suffix`: that, then the recent outputs of every request (as vLLM's `suffix` decoding does
  across requests), namespaced by cache_salt;
- `radix`: first the prefix cache's own continuation where the request's tokens so far lie on
  a cached path (a regenerated answer, a repeated agent step), then as `suffix`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "suffix", "radix")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration (vLLM's keys and meanings)."""

    method: str = "radix"
    num_speculative_tokens: int = 5  # the most drafted tokens verified per step
    prompt_lookup_min: int = 2  # shortest n-gram a lookup drafts from
    prompt_lookup_max: int = 4  # longest n-gram tried first

    def to_json(self) -> str:
        """The canonical JSON text of this configuration."""
        return json.dumps(
            {
                "method": self.method,
                "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max,
            }
        )


def parse_speculative_config(value: str | dict[str, Any]) -> SpeculativeConfig:
    """A SpeculativeConfig from JSON text or a dict; ValueError (one line naming the key and
    what is allowed) for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(
                f"not valid JSON ({e}); e.g. {SpeculativeConfig().to_json()}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(
            'must be a JSON object, e.g. {"method": "radix", "num_speculative_tokens": 5}'
        )
    known = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; the keys are {', '.join(known)}")
    method = value.get("method", "radix")
    if method not in SPEC_METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(SPEC_METHODS)}")
    num = _int(value, "num_speculative_tokens", 5, 1, MAX_SPECULATIVE_TOKENS)
    lo = _int(value, "prompt_lookup_min", 2, 1, 64)
    hi = _int(value, "prompt_lookup_max", max(4, lo), 1, 64)
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
    return SpeculativeConfig(method, num, lo, hi)


def speculative_config_arg(text: str) -> str:
    """argparse type of `--speculative-config`: the canonical JSON of a valid configuration."""
    try:
        return parse_speculative_config(text).to_json()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int(value: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    got = value.get(key, default)
    if isinstance(got, bool) or not isinstance(got, int) or not lo <= got <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], got {got!r}")
    return got
