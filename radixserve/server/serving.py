"""/v1/completions and /v1/chat/completions: request -> tokens -> engine -> OpenAI response."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.engine.structured import StructuredOutput
from radixserve.errors import ModelNotFoundError, PromptTooLongError
from radixserve.server.bridge import EngineBridge, OutputStream, abort_on_disconnect
from radixserve.server.chat import ChatResponder
from radixserve.server.completion import CompletionResponder
from radixserve.server.constraints import structured_output, tool_mode
from radixserve.server.errors import APIError
from radixserve.server.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    read_json_body,
)
from radixserve.server.tiers import bearer_token, session_id
from radixserve.server.usage import failure, usage

if TYPE_CHECKING:
    from radixserve.server.disagg import DecodeRole
    from radixserve.server.engine_api import ServedEngine

# When a request sets no max_tokens it gets what fits in the context, at most this many.
DEFAULT_MAX_TOKENS = 256
# Texts longer than this are tokenized in a worker thread so the event loop stays responsive.
_INLINE_TOKENIZE_CHARS = 8192
# A grammar still compiling after this long is answered with a 400 (it keeps compiling in
# its worker thread and is cached, so the same spec sent again may then be served).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

__all__ = ["DEFAULT_MAX_TOKENS", "SSE_HEADERS", "OpenAIServing", "failure", "usage"]


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: ServedEngine,
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
        self.decode: DecodeRole | None = None  # a decode worker's handoffs (server/disagg.py)
        # Grammars compile here, never on the event loop or the engine thread; two workers
        # so one slow schema does not hold up every other new one.
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="radixserve-grammar")

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        body = await read_json_body(request, self.max_body_bytes)
        req: CompletionRequest = parse_body(CompletionRequest, body)
        self._check(req)
        tok = self.engine.tokenizer
        if isinstance(req.prompt, str):
            prompt_ids = await _maybe_in_thread(tok.encode, req.prompt, len(req.prompt))
            echo_text = req.prompt
        else:
            prompt_ids = req.prompt  # the engine checks the ids against the vocabulary
            echo_text = tok.decode(prompt_ids, skip_special_tokens=False) if req.echo else ""
        logprobs = req.logprobs
        scoring = {"logprobs": logprobs, "best_of": req.best_of}
        if req.echo and logprobs is not None:
            scoring["prompt_logprobs"] = logprobs
        params = await self._params(req, prompt_ids, "prompt", **scoring)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._submit(request, req, prompt_ids, rid, params)
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        responder = CompletionResponder(tok, base, echo_text if req.echo else None, logprobs)
        if req.stream:
            return _sse_response(responder.events(stream, req.include_usage))
        outs = await _collect(request, stream)
        choices = [responder.choice(o) for o in outs]
        return JSONResponse({**base, "choices": choices, "usage": usage(outs)})

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        body = await read_json_body(request, self.max_body_bytes)
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
        self._check(req)
        messages, tools = req.message_dicts(), req.tool_dicts()
        size = sum(len(str(m.get("content", ""))) for m in messages)
        prompt_ids = await _maybe_in_thread(
            lambda ms: self.engine.tokenizer.apply_chat_template(ms, tools=tools), messages, size
        )
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = await self._params(req, prompt_ids, "messages", logprobs=top)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._submit(request, req, prompt_ids, rid, params)
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.name}
        mode = tool_mode(req)
        names = [t.function.name for t in req.tools or []] if mode != "none" else []
        constrained = mode in ("required", "named")
        responder = ChatResponder(self.engine.tokenizer, base, names, top, constrained)
        if req.stream:
            responder.base = {**base, "object": "chat.completion.chunk"}
            return _sse_response(responder.events(stream, req.include_usage))
        outs = await _collect(request, stream)
        choices = [responder.choice(o) for o in outs]
        return JSONResponse({**base, "choices": choices, "usage": usage(outs)})

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
        if req.best_of_value() > 1 and not self.bridge.supports_choices:
            param = "n" if req.n > 1 else "best_of"
            raise APIError(400, f"{param} > 1 is not available on this deployment", param=param)

    async def _params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
        **scoring: Any,
    ) -> SamplingParams:
        """The engine's SamplingParams for `req`, its grammar compiled (or refused) first."""
        spec = structured_output(req)
        if spec is not None:
            await self._compile(spec)
        return SamplingParams(
            max_tokens=self._max_tokens(req.requested_max_tokens(), len(prompt_ids), prompt_param),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logit_bias=req.bias(),
            min_tokens=req.min_tokens,
            n=req.n,
            structured=spec,
            **scoring,
        )

    async def _compile(self, spec: StructuredOutput) -> None:
        """Compile `spec` in a worker thread (a cache hit returns at once); a 400 naming the
        field when it does not compile, or not within GRAMMAR_COMPILE_TIMEOUT_S."""
        grammars = self.engine.grammars
        if grammars is None or grammars.cached(spec) is not None:
            return  # an engine elsewhere (Ray) compiles it when the request arrives
        loop = asyncio.get_running_loop()
        task = loop.run_in_executor(self._compiler, grammars.compile, spec)
        task.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen if abandoned
        try:
            await asyncio.wait_for(asyncio.shield(task), GRAMMAR_COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(
                400,
                f"{spec.param}: the {spec.kind} grammar did not compile within "
                f"{GRAMMAR_COMPILE_TIMEOUT_S:.0f} s; simplify it",
                param=spec.param,
            ) from None

    async def _submit(
        self,
        request: Request,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        rid: str,
        params: SamplingParams,
    ) -> OutputStream:
        tier = self.api_key_tiers.get(bearer_token(request) or "")
        session_key = req.user or getattr(req, "prompt_cache_key", None)
        handed: dict[str, Any] = {}  # bridge.submit's handoff arguments, if prefilled elsewhere
        if self.decode is not None:  # prefilled on the worker kv_transfer_params names
            handed = await self.decode.handoff(
                prompt_ids, params, req.cache_salt, req.kv_transfer_params
            )
        return await self.bridge.submit(
            prompt_ids,
            params,
            request_id=rid,
            namespace=req.cache_salt,
            priority=req.priority if tier is None else tier,
            session_id=session_id(request, session_key),
            stream=bool(req.stream),
            **handed,
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


async def _maybe_in_thread(fn: Callable[[Any], list[int]], arg: Any, size: int) -> list[int]:
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)


async def _collect(request: Request, stream: OutputStream) -> list[RequestOutput]:
    """Wait for a non-streaming request's final outputs (every choice, by index); a client
    that leaves aborts it."""
    try:
        async with abort_on_disconnect(request, stream):
            outs = await stream.results()
    finally:
        stream.close()
    if stream.client_gone:  # nobody reads this; 499 keeps it apart from real errors in metrics
        raise APIError(499, "the client closed the request", code="client_closed_request")
    for out in outs:
        err = failure(out)
        if err is not None:
            raise err
    return outs


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
