"""API-key auth, one check for the server and the router: `Authorization: Bearer <key>` against
each accepted key, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request

MESSAGE = "missing or incorrect API key; send 'Authorization: Bearer <key>'"
CODE = "invalid_api_key"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


class ApiKeys:
    """The keys a server or router accepts."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._expected = [f"Bearer {k}".encode() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._expected)

    def allow(self, request: Request) -> bool:
        """Whether `request` carries one of the keys. Every key is compared (no early exit),
        so the time taken does not tell which one matched."""
        given = request.headers.get("authorization", "").encode()
        return bool(sum(hmac.compare_digest(given, e) for e in self._expected))
