"""--max-request-body-bytes: a REST request body larger than the limit is answered 413 (in
OpenAI's error shape) before the application parses any of it. A declared Content-Length over
the limit is refused at once; a chunked body is counted as it arrives and refused as soon as it
passes the limit (what was read so far is dropped). Bodies within the limit are handed to the
application as they were received."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large(limit: int) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": f"request body larger than {limit} bytes (--max-request-body-bytes)",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    ).encode()


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        received: list[Message] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                received.append(message)
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._refuse(send)
                return
            received.append(message)
            if not message.get("more_body", False):
                break
        replay = iter(received)

        async def replayed() -> Message:
            for message in replay:
                return message
            return await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Send) -> None:
        body = _too_large(self.max_bytes)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
