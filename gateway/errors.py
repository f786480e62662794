"""ApiError: every failure a client can see, with its HTTP status, gRPC code and OpenAI body."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import grpc

_GRPC_CODES = {
    HTTPStatus.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    HTTPStatus.TOO_MANY_REQUESTS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HTTPStatus.INTERNAL_SERVER_ERROR: grpc.StatusCode.INTERNAL,
    HTTPStatus.SERVICE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    HTTPStatus.GATEWAY_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class ApiError(Exception):
    """A request failed in a way the client should be told about.

    ``type`` and ``code`` follow OpenAI's error object (``invalid_request_error``,
    ``not_found_error``, ...); ``param`` names the offending request field when there is one.
    """

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        """Seconds the client should wait before retrying (sent as Retry-After)."""

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(HTTPStatus.BAD_REQUEST, message, "invalid_request_error", param)

    @classmethod
    def model_not_found(cls, model: str) -> ApiError:
        message = f"The model `{model}` does not exist."
        return cls(HTTPStatus.NOT_FOUND, message, "not_found_error", "model", "model_not_found")

    @classmethod
    def too_many_requests(cls, message: str, retry_after_s: int = 1) -> ApiError:
        return cls(
            HTTPStatus.TOO_MANY_REQUESTS,
            message,
            "rate_limit_error",
            code="too_many_requests",
            retry_after_s=retry_after_s,
        )

    @classmethod
    def unavailable(cls, message: str, retry_after_s: int = 1) -> ApiError:
        return cls(
            HTTPStatus.SERVICE_UNAVAILABLE,
            message,
            "service_unavailable_error",
            code="service_unavailable",
            retry_after_s=retry_after_s,
        )

    @classmethod
    def internal(cls, message: str) -> ApiError:
        return cls(HTTPStatus.INTERNAL_SERVER_ERROR, message, "internal_server_error")

    @classmethod
    def timeout(cls, message: str) -> ApiError:
        return cls(HTTPStatus.GATEWAY_TIMEOUT, message, "timeout_error", code="timeout")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.UNKNOWN)

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
