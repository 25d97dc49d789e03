"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_validation_errors(errors: list[dict]) -> APIError:
    """A pydantic ValidationError's errors() -> a 400 naming the first offending field."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
