"""The worker's HTTP answers that are not a route's own: its errors (OpenAI's error object),
the 503 that tells the gateway a request never ran, a request's JSON body read with its
errors answered, and a streamed response that stops its sequences when the client hangs up."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive

from runtime.early_requests import NEVER_RAN_HEADER, NOT_STARTED
from runtime.engine.scheduler import KVCacheExhausted, RequestFailed, SloUnattainable
from runtime.errors import error_body
from runtime.openai_api import RequestError


def error_answer(
    status: int, kind: str, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """Every error answer of the worker: OpenAI's error object (:func:`runtime.errors.error_body`)."""
    return JSONResponse(error_body(kind, message, param, code), status_code=status)


def never_ran(instance_id: str, why: str) -> JSONResponse:
    """503 :data:`NOT_STARTED`: a request for ``instance_id`` did not run here, and the gateway
    may send it elsewhere (:data:`NEVER_RAN_HEADER`)."""
    response = error_answer(503, NOT_STARTED, why)
    response.headers[NEVER_RAN_HEADER] = instance_id
    response.headers["Retry-After"] = "1"
    return response


def bad_request(exc: RequestError) -> JSONResponse:
    return error_answer(400, "invalid_request_error", str(exc), exc.param, exc.code)


async def json_body(raw: Request) -> Any:
    """The request's JSON body, or a 400 response (invalid or too deeply nested JSON)."""
    try:
        return json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        return error_answer(400, "invalid_request_error", f"body is not valid JSON: {exc}")
    except ValueError:  # int() refuses more digits than sys.get_int_max_str_digits()
        digits = sys.get_int_max_str_digits()
        return error_answer(
            400, "invalid_request_error", f"body is not valid JSON: a number has more than {digits} digits"
        )


class HangUpStreamingResponse(StreamingResponse):
    """A streamed response that stops its requests' sequences the moment the client hangs up.
    Starlette notices the hang-up but may not stop iterating the body (the stream went on to
    its end, 1,000 SmolLM2 tokens and ~10 s of both cores for nobody): ``hang_up`` aborts the
    sequences and ends their streams instead."""

    def __init__(self, content: AsyncIterator[bytes], hang_up: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._hang_up = hang_up

    async def listen_for_disconnect(self, receive: Receive) -> None:
        await super().listen_for_disconnect(receive)
        self._hang_up()  # after a finished response too: its sequences are finished, a no-op


def failed_answer(exc: RequestFailed) -> JSONResponse:
    """No KV room, or no room within the SLO, is a 503 (retry later); an engine failure is a
    500 (a bug, logged)."""
    if isinstance(exc, KVCacheExhausted | SloUnattainable):
        response = error_answer(503, exc.code, str(exc))
        response.headers["Retry-After"] = "1"
        return response
    return error_answer(500, exc.code, str(exc))
