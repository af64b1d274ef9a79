"""The one place where errors become HTTP statuses and OpenAI-style JSON error bodies."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
    RadixServeError,
    RequestTooLargeError,
)

RETRY_AFTER_SECONDS = 1

# OpenAI's `type` field by status; `code` is set per error where a client may branch on it.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status, ready to be rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients understand."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPE_BY_STATUS.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """This error as a response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to an APIError; the status of each error type is decided here only."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestTooLargeError):
        return APIError(400, str(exc), param=exc.param, code="request_too_large")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, QueueFullError):
        return APIError(
            503,
            str(exc) or "the server is overloaded; retry later",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc) or "the engine is not running", code="engine_dead")
    if isinstance(exc, RadixServeError):
        return APIError(400, str(exc))
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    if isinstance(exc, RequestValidationError):
        return APIError(400, "invalid request")
    return APIError(500, "internal server error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Render every error the app can raise as an OpenAI error body; never a stack trace."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        # Unexpected exceptions are logged (with their trace) by Starlette's error middleware.
        return to_api_error(exc).response()

    for exc_type in (
        APIError,
        RadixServeError,
        StarletteHTTPException,
        RequestValidationError,
        Exception,
    ):
        app.add_exception_handler(exc_type, handle)
