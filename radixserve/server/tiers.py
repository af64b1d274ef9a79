"""API-key tiers (`--api-key-tiers FILE`): which cache-retention tier each API key gets."""

from __future__ import annotations

import json
from pathlib import Path

from starlette.requests import Request


def load_api_key_tiers(path: str | Path) -> dict[str, int]:
    """Read a JSON object {"api key": tier, ...} (tiers are integers, higher kept longer).

    Raises ValueError naming the problem when the file is not such an object.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read API-key tiers from {path}: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON object of api key -> integer tier")
    for key, tier in data.items():
        if not key or not isinstance(tier, int) or isinstance(tier, bool):
            raise ValueError(f"{path}: tier of key {key[:4]!r}... must be an integer")
    return dict(data)


def bearer_token(request: Request) -> str | None:
    """The token of an 'Authorization: Bearer ...' header, if any."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def session_id(request: Request, user: str | None) -> str | None:
    """A request's session: its `x-session-id` header, else the body's `user` field."""
    return request.headers.get("x-session-id") or user or None
