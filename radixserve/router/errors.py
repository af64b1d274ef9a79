"""The router's error answers: OpenAI-style error bodies."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(status: int, message: str, type_: str = "upstream_error") -> JSONResponse:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)
