"""/v1/completions and /v1/chat/completions: request -> tokens -> engine -> OpenAI response."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.errors import ModelNotFoundError, PromptTooLongError
from radixserve.server.bridge import EngineBridge, RequestStream, abort_on_disconnect
from radixserve.server.errors import APIError
from radixserve.server.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    read_json_body,
    sse,
)
from radixserve.server.tiers import bearer_token, session_id

if TYPE_CHECKING:
    from radixserve.engine.engine import LLMEngine

# When a request sets no max_tokens it gets what fits in the context, at most this many.
DEFAULT_MAX_TOKENS = 256
# Texts longer than this are tokenized in a worker thread so the event loop stays responsive.
_INLINE_TOKENIZE_CHARS = 8192

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage object, with the prompt tokens served from the prefix cache."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def failure(out: RequestOutput) -> APIError | None:
    """The error a finished output stands for, if it did not finish normally."""
    if out.finish_reason in ("stop", "length"):
        return None
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted (server shutting down?)", code="aborted")
    return APIError(500, f"generation failed: {out.error or 'engine error'}", code="engine_error")


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: LLMEngine,
        bridge: EngineBridge,
        model_names: list[str],
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.engine = engine
        self.bridge = bridge
        self.model_names = model_names
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.api_key_tiers: dict[str, int] = {}  # api key -> cache-retention tier

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        body = await read_json_body(request, self.max_body_bytes)
        req: CompletionRequest = parse_body(CompletionRequest, body)
        self._check(req)
        if isinstance(req.prompt, str):
            prompt_ids = await _maybe_in_thread(
                self.engine.tokenizer.encode, req.prompt, len(req.prompt)
            )
        else:
            prompt_ids = req.prompt  # the engine checks the ids against the vocabulary
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._submit(request, req, prompt_ids, rid, "prompt")
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        if req.stream:
            return _sse_response(self._completion_events(stream, base, req.include_usage))
        out = await _collect(request, stream)
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        return JSONResponse({**base, "choices": [choice], "usage": usage(out)})

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        body = await read_json_body(request, self.max_body_bytes)
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
        self._check(req)
        messages = req.message_dicts()
        size = sum(len(str(m.get("content", ""))) for m in messages)
        prompt_ids = await _maybe_in_thread(
            self.engine.tokenizer.apply_chat_template, messages, size
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._submit(request, req, prompt_ids, rid, "messages")
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.name}
        if req.stream:
            chunk_base = {**base, "object": "chat.completion.chunk"}
            return _sse_response(self._chat_events(stream, chunk_base, req.include_usage))
        out = await _collect(request, stream)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        return JSONResponse({**base, "choices": [choice], "usage": usage(out)})

    @property
    def name(self) -> str:
        """The model name responses carry."""
        return self.model_names[0]

    def _check(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model is not None and req.model not in self.model_names:
            raise ModelNotFoundError(
                f"the model '{req.model}' does not exist; this server serves "
                + ", ".join(repr(n) for n in self.model_names)
            )
        err = req.unsupported()
        if err is not None:
            raise err

    async def _submit(
        self,
        request: Request,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        rid: str,
        prompt_param: str,
    ) -> RequestStream:
        params = SamplingParams(
            max_tokens=self._max_tokens(req.requested_max_tokens(), len(prompt_ids), prompt_param),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            ignore_eos=req.ignore_eos,
        )
        tier = self.api_key_tiers.get(bearer_token(request) or "")
        return await self.bridge.submit(
            prompt_ids,
            params,
            request_id=rid,
            namespace=req.cache_salt,
            priority=req.priority if tier is None else tier,
            session_id=session_id(request, req.user),
            stream=bool(req.stream),
        )

    def _max_tokens(self, requested: int | None, num_prompt: int, prompt_param: str) -> int:
        limit: int = self.engine.max_model_len
        if num_prompt >= limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens, "
                f"but the prompt has {num_prompt} tokens",
                prompt_param,
            )
        if requested is None:
            return min(self.default_max_tokens, limit - num_prompt)
        if num_prompt + requested > limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens, but "
                f"{num_prompt + requested} were requested ({num_prompt} in the prompt, "
                f"{requested} in the completion); reduce the prompt or max_tokens",
                "max_tokens",
            )
        return requested

    async def _completion_events(
        self, stream: RequestStream, base: dict[str, Any], include_usage: bool
    ) -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}
        try:
            async for out in stream:
                if out.finished and (err := failure(out)) is not None:
                    yield sse(err.body())
                    break
                if out.new_text or out.finished:
                    choice = {
                        "index": 0,
                        "text": out.new_text,
                        "logprobs": None,
                        "finish_reason": out.finish_reason if out.finished else None,
                    }
                    yield sse({**base, "choices": [choice], **extra})
            if include_usage and stream.final is not None and failure(stream.final) is None:
                yield sse({**base, "choices": [], "usage": usage(stream.final)})
            yield b"data: [DONE]\n\n"
        finally:
            stream.close()

    async def _chat_events(
        self, stream: RequestStream, base: dict[str, Any], include_usage: bool
    ) -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return sse({**base, "choices": [choice], **extra})

        try:
            yield chunk({"role": "assistant", "content": ""})
            async for out in stream:
                if out.finished and (err := failure(out)) is not None:
                    yield sse(err.body())
                    break
                if out.new_text:
                    yield chunk({"content": out.new_text})
                if out.finished:
                    yield chunk({}, out.finish_reason)
            if include_usage and stream.final is not None and failure(stream.final) is None:
                yield sse({**base, "choices": [], "usage": usage(stream.final)})
            yield b"data: [DONE]\n\n"
        finally:
            stream.close()


async def _maybe_in_thread(fn: Callable[[Any], list[int]], arg: Any, size: int) -> list[int]:
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)


async def _collect(request: Request, stream: RequestStream) -> RequestOutput:
    """Wait for a non-streaming request's final output; a client that leaves aborts it."""
    try:
        async with abort_on_disconnect(request, stream):
            out = await stream.result()
    finally:
        stream.close()
    if stream.client_gone:  # nobody reads this; 499 keeps it apart from real errors in metrics
        raise APIError(499, "the client closed the request", code="client_closed_request")
    err = failure(out)
    if err is not None:
        raise err
    return out


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
