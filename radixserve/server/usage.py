"""What a finished request reports: OpenAI's usage object, and the error it stands for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.engine.outputs import RequestOutput
from radixserve.server.errors import APIError


def usage(outs: RequestOutput | Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage object over every choice of a request (the prompt counted once), with
    the prompt tokens served from the prefix cache (choice 0's: the others start from its
    blocks) and, where speculative decoding drafted tokens, how many were accepted."""
    choices = [outs] if isinstance(outs, RequestOutput) else list(outs)
    first = min(choices, key=lambda o: o.index)
    prompt = len(first.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in choices)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens},
    }
    drafted = sum(o.metrics.num_draft_tokens for o in choices)
    if drafted:  # speculative decoding, as OpenAI reports Predicted Outputs
        accepted = sum(o.metrics.num_accepted_tokens for o in choices)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


def failure(out: RequestOutput | None) -> APIError | None:
    """The error a finished output stands for, if it did not finish normally."""
    if out is None:
        return APIError(500, "generation failed: no output", code="engine_error")
    if out.finish_reason in ("stop", "length"):
        return None
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted (server shutting down?)", code="aborted")
    return APIError(500, f"generation failed: {out.error or 'engine error'}", code="engine_error")
