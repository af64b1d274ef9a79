"""radixserve: an LLM inference server built around a radix-tree prefix cache."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `radixserve.cache` and the CLI's help do not pay for importing torch.
    if name == "LLM":
        from radixserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from radixserve.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
