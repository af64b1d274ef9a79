"""After a step: a sampled token becomes text, the stop checks decide whether its request
ends, and each request's new output is taken for its callback. This module owns a request's
output state (`token_ids` past the prompt, `text`, what was delivered)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from radixserve.engine.handoff import FirstToken, KVHandoff
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.request import Request

log = logging.getLogger(__name__)


def append_token(
    req: Request, token: int, eos_ids: Collection[int], max_model_len: int
) -> str | None:
    """Append `token` to `req`, add its text unless it is a stop token, and return why `req`
    stops now, if it does: "stop" (EOS, a stop token id, or a stop string, which is cut from
    the text) or "length" (max_tokens, or the context is full)."""
    req.token_ids.append(token)
    p = req.params
    early = len(req.output_token_ids) <= p.min_tokens  # EOS and stops cannot end it yet
    if not early and ((token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
        req.stop_reason = token
        return "stop"
    delta = req.detokenizer.add(token)
    if delta and _add_text(req, delta, early):
        return "stop"
    if len(req.output_token_ids) >= p.max_tokens or len(req.token_ids) >= max_model_len:
        return "length"
    return None


def _add_text(req: Request, delta: str, early: bool = False) -> bool:
    """Append `delta` to `req.text`; True (with the text cut there) if a stop string ends in
    it, unless `early` (min_tokens not reached). Only the tail where a new match can start
    is searched."""
    stops = req.params.stop
    start = max(0, len(req.text) - max((len(s) for s in stops), default=0))
    req.text += delta
    if early:
        return False
    for s in stops:
        idx = req.text.find(s, start)
        if idx != -1:
            req.text = req.text[:idx]
            req.stop_reason = s
            return True
    return False


def take_output(req: Request, finished: bool = False) -> RequestOutput:
    """The output callers see now, with the delta since the last one taken, which this marks
    as delivered. Until `finished`, a text tail that could still grow into a stop string is
    held back."""
    out_ids = req.output_token_ids
    new_ids = out_ids[req.emitted_tokens :]
    visible = len(req.text) if finished else _stable_text_len(req)
    new_text = req.text[req.emitted_chars : visible]
    req.emitted_tokens = len(out_ids)
    req.emitted_chars = max(req.emitted_chars, visible)
    return RequestOutput(
        request_id=req.group_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(out_ids),
        text=req.text[:visible] if not finished else req.text,
        new_token_ids=new_ids,
        new_text=new_text,
        finished=finished,
        finish_reason=req.finish_reason,
        num_cached_tokens=req.metrics.num_cached_tokens,
        metrics=req.metrics,
        error=req.error,
        logits=list(req.logits) if finished else [],
        index=req.index,
        logprobs=list(req.logprobs) if req.logprobs is not None else None,
        prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
        stop_reason=req.stop_reason,
        kv_handoff=_handoff(req) if finished else None,
    )


def _handoff(req: Request) -> KVHandoff | None:
    """What a finished prefill worker's request hands a decode worker, if it is one."""
    if req.kv_export is None or req.export_kv_from is None or not req.output_token_ids:
        return None
    ids, k, v, window = req.kv_export
    logprobs = req.logprobs[0] if req.logprobs else None
    first = FirstToken(req.output_token_ids[0], logprobs, req.metrics.num_cached_tokens)
    return KVHandoff(ids, min(req.export_kv_from, len(ids)), k, v, first, window)


def _stable_text_len(req: Request) -> int:
    if not req.params.stop:
        return len(req.text)
    hold = max(len(s) for s in req.params.stop) - 1
    return max(req.emitted_chars, len(req.text) - hold)


def deliver(req: Request, finished: bool) -> None:
    """Hand `req`'s new output to its callback, if it has one (an exception there is logged,
    never raised into the engine loop)."""
    if req.on_output is None:
        return
    try:
        req.on_output(take_output(req, finished))
    except Exception:
        log.exception("output callback of %s raised", req.request_id)
