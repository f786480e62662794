"""--api-key: Bearer authentication on the gateway's REST routes, as vLLM's server does it.

Every route needs `Authorization: Bearer <key>` except the ones probes and scrapers call
without credentials (/health, /metrics, /version) and the dashboard page itself (its data,
/dashboard/data, needs the key: it lists internal node addresses, as /metrics/targets and the
OpenAPI document do). Keys are compared in constant time. Without --api-key nothing is checked:
the gateway binds 127.0.0.1 by default, and a deployment that opens it wide sets a key.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/dashboard"})
"""Paths served without the key."""

_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "missing or incorrect API key (send Authorization: Bearer <key>)",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


class ApiKeyMiddleware:
    """Pure ASGI (works for streaming responses too): 401 in OpenAI's error shape unless the
    request carries the key."""

    def __init__(self, app: ASGIApp, api_key: str, root_path: str = "") -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or self._open(scope):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})

    def _open(self, scope: Scope) -> bool:
        path = scope["path"].removeprefix(self._root_path) or "/"
        return path in OPEN_PATHS
