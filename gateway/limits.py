"""Bounds on what a client may send the gateway: body size, body read time, JSON depth.

Every request body passes :class:`BodyLimits` (outermost ASGI middleware): a declared
``Content-Length`` over the cap is answered 413 before one body byte is read; a chunked
body is counted as it arrives and stopped at the cap (:class:`BodyTooLarge`, 413); a body
that does not arrive within ``body_timeout_s`` is :class:`BodyTimeout` (408). Both carry
``Connection: close``: the rest of the body is never read, so the connection cannot serve
another request. The header read timeout and size cap (:class:`runtime.http_server.HeaderLimits`,
shared with the workers' servers) are enforced by :mod:`runtime.http_server`.
:func:`load_json` parses JSON with a depth bound (:class:`JSONError`, 400).
:class:`DeployLimits` bounds how many functions a namespace may hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.http_server import HeaderLimits, env_values

MAX_JSON_DEPTH = 64  # nesting of arrays/objects; OpenAI requests and events need < 10


class EdgeError(Exception):
    """A request the gateway refuses at its edge; ``code`` is the wire error type."""

    code = "invalid_request_error"


class BodyTooLarge(EdgeError):
    """The request body exceeds the route's cap (HTTP 413)."""

    code = "request_too_large"


class BodyTimeout(EdgeError):
    """The request body did not arrive within the body read timeout (HTTP 408)."""

    code = "request_timeout"


class JSONError(EdgeError, ValueError):
    """A body is not JSON, or nests deeper than allowed (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """Caps on request bodies and read times (bytes, seconds), and on request headers."""

    max_body_bytes: int = 4 << 20  # any request (invocations: prompts, events)
    # POST /v1/functions: a spec plus its handler module (<= 256 KiB, up to 2x when JSON-escaped)
    max_spec_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # from the first receive to the body's last byte
    headers: HeaderLimits = field(default_factory=HeaderLimits)  # read time and size of headers

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_spec_bytes < 1:
            raise ValueError("max_body_bytes and max_spec_bytes must be >= 1")
        if not 0 < self.body_timeout_s <= 3600:  # also refuses NaN
            raise ValueError("body_timeout_s must be in (0, 3600] seconds")

    @classmethod
    def from_env(cls) -> EdgeLimits:
        """``EMBER_MAX_BODY_BYTES``, ``EMBER_MAX_SPEC_BYTES`` (integers), ``EMBER_BODY_TIMEOUT``
        (seconds), and the header limits (:meth:`HeaderLimits.from_env`); unset ones keep
        their defaults, bad ones raise."""
        values = env_values(
            (
                ("EMBER_MAX_BODY_BYTES", "max_body_bytes", int),
                ("EMBER_MAX_SPEC_BYTES", "max_spec_bytes", int),
                ("EMBER_BODY_TIMEOUT", "body_timeout_s", float),
            )
        )
        try:
            return cls(headers=HeaderLimits.from_env(), **values)
        except ValueError as exc:
            raise ValueError(f"EMBER_* request limits: {exc}") from None


DEFAULT_MAX_FUNCTIONS = 1000  # per namespace
# Instances a namespace keeps up by minScale, summed over its functions: each is a worker
# process (~0.6 GiB of private memory serving SmolLM2 on CPU) running with no request at all.
DEFAULT_MAX_MIN_SCALE = 16


@dataclass(frozen=True, slots=True)
class DeployLimits:
    """A tenant's quota: how many functions one namespace may hold (redeploys do not count) and
    how many instances its functions may keep up by ``minScale``, together."""

    max_functions_per_namespace: int = DEFAULT_MAX_FUNCTIONS
    max_min_scale_per_namespace: int = DEFAULT_MAX_MIN_SCALE

    def __post_init__(self) -> None:
        # The caps are checked by a Lua script that scans the function hashes: keep them numbers
        # a deployment could mean, not a way to disable the check.
        if not 1 <= self.max_functions_per_namespace <= 1_000_000:
            raise ValueError("max_functions_per_namespace must be in [1, 1000000]")
        if not 0 <= self.max_min_scale_per_namespace <= 1_000_000:
            raise ValueError("max_min_scale_per_namespace must be in [0, 1000000]")

    @classmethod
    def from_env(cls) -> DeployLimits:
        """``EMBER_MAX_FUNCTIONS_PER_NAMESPACE`` and ``EMBER_MAX_MIN_SCALE_PER_NAMESPACE``
        (integers; unset: the defaults, bad: raise naming the variable)."""
        table = (
            ("EMBER_MAX_FUNCTIONS_PER_NAMESPACE", "max_functions_per_namespace", int),
            ("EMBER_MAX_MIN_SCALE_PER_NAMESPACE", "max_min_scale_per_namespace", int),
        )
        values = env_values(table)
        try:
            return cls(**values)
        except ValueError as exc:
            given = [env for env, _, _ in table if env in os.environ]
            raise ValueError(f"{', '.join(given)}: {exc}") from None


# Renders an error as the gateway's JSON error response (gateway.app's one table).
Render = Callable[[Exception], Response]


class BodyLimits:
    """ASGI middleware bounding every HTTP request body in size and read time.

    ``cap(scope)`` is the route's byte cap. Exceptions raised from the wrapped ``receive``
    surface in whatever reads the body (FastAPI route or the invocation fast path), which
    map them to JSON errors like any other.
    """

    def __init__(self, app: ASGIApp, limits: EdgeLimits, cap: Callable[[Scope], int], render: Render):
        self.app = app
        self.limits = limits
        self.cap = cap
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.cap(scope)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1  # the HTTP parser has rejected such requests already
                if declared > cap:  # refused before one body byte is read
                    await self.render(_too_large(cap))(scope, receive, send)
                    return
                break
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        received = 0
        done = False

        async def bounded_receive() -> Message:
            nonlocal received, done
            if done:  # the body is in: later receives wait for a disconnect, unbounded
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(
                    f"the request body did not arrive within {self.limits.body_timeout_s:g} s"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _too_large(cap)
                done = not message.get("more_body", False)
            return message

        await self.app(scope, bounded_receive, send)


def _too_large(cap: int) -> BodyTooLarge:
    return BodyTooLarge(f"the request body exceeds this route's limit of {cap} bytes")


TOO_MANY_DIGITS = f"a number has more than {sys.get_int_max_str_digits()} digits"


def load_json(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(body)``, but :class:`JSONError` (never RecursionError) for invalid JSON or
    arrays/objects nested deeper than ``max_depth``."""
    try:
        document = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JSONError(str(exc)) from None
    except ValueError:  # int() refuses more digits than sys.get_int_max_str_digits()
        raise JSONError(TOO_MANY_DIGITS) from None
    except RecursionError:  # the C scanner stops at the interpreter's recursion limit
        raise JSONError(f"JSON nested deeper than {max_depth} levels") from None
    if isinstance(body, bytes):
        brackets = body.count(b"[") + body.count(b"{")
    else:
        brackets = body.count("[") + body.count("{")
    if brackets > max_depth:  # else it cannot be too deep: skip the walk
        check_depth(document, max_depth, JSONError)
    return document


def check_depth(document: Any, max_depth: int, error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` if lists/dicts in ``document`` nest deeper than ``max_depth``
    (iterative: the check itself never recurses)."""
    stack: list[tuple[Any, int]] = [(document, 1)] if isinstance(document, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > max_depth:
            raise error(f"JSON nested deeper than {max_depth} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
