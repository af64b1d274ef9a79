"""After the model step: stop checks and incremental detokenization of a new token."""

from __future__ import annotations

from collections.abc import Collection

from radixserve.engine.request import Request


def check_stop(
    req: Request, token: int, eos_ids: Collection[int], max_model_len: int
) -> str | None:
    """Detokenize `token` (just appended to `req`) and say why `req` stops, if it does:
    "stop" (EOS, a stop token, or a stop string, which is cut from the text) or "length"."""
    p = req.params
    stop_token = (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids
    if not stop_token:
        delta = req.detokenizer.add(token)
        if delta:
            start = max(0, len(req.text) - max((len(s) for s in p.stop), default=0))
            req.text += delta
            for s in p.stop:
                idx = req.text.find(s, start)
                if idx != -1:
                    req.text = req.text[:idx]
                    return "stop"
    if stop_token:
        return "stop"
    if len(req.output_token_ids) >= p.max_tokens or len(req.token_ids) >= max_model_len:
        return "length"
    return None
