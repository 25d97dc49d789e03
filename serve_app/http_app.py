"""The HTTP layer both topologies share: the FastAPI apps with OpenAI-shaped errors, API-key
authorisation, request parsing (size, JSON, schema) and server-sent events."""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.errors import APIError, from_validation_errors

MAX_BODY_BYTES = 1 << 20  # 1 MiB



async def _validation_handler(_request, exc: RequestValidationError):
    return from_validation_errors(exc.errors()).response()


async def _http_error_handler(_request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail)).response()


async def _api_error_handler(_request, exc: APIError):
    return exc.response()


def _openai_app() -> FastAPI:
    """A FastAPI app whose errors are OpenAI-shaped."""
    out = FastAPI(title="specserve", description="OpenAI-compatible API with lossless speculative decoding")
    out.add_exception_handler(RequestValidationError, _validation_handler)
    out.add_exception_handler(StarletteHTTPException, _http_error_handler)
    out.add_exception_handler(APIError, _api_error_handler)
    return out


app = _openai_app()  # the single deployment's routes (LLMServer)
ingress_app = _openai_app()  # the ingress topology's routes (OpenAIIngress)


def authorize(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (no key configured: open)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")


async def parse_request(request: Request, schema, api_key: str | None):
    """The authorised, size-checked, JSON-parsed and schema-validated request body (no tokenizer)."""
    authorize(request, api_key)
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def respond(result: dict | AsyncIterator[str]):
    return result if isinstance(result, dict) else sse(result)
