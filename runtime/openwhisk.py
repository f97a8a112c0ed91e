"""OpenWhisk's action interface on the worker (``ember worker --openwhisk``): the same image
serves as a blackbox action.

OpenWhisk's invoker starts the container, ``POST /init`` once, then ``POST /run`` for each
activation (the action interface of its runtimes, ``apache/openwhisk`` ``docs/actions-new.md``):

* ``/init`` body ``{"value": {...}}``. For Ember ``value.code`` is the function spec document,
  YAML or JSON text (what ``wsk action create NAME function.yaml --docker IMAGE`` sends;
  without it the composition root may fall back to a spec baked into the image).
  ``value.env`` (optional, a mapping) is set in ``os.environ`` for the action's code, except
  ``EMBER_*`` names (the container's own settings, not the action's), ``__OW_*`` ones
  (an activation's) and those that change what the process loads or runs (``LD_*``,
  ``GLIBC_*``, ``MALLOC_*``, ``PYTHON*``, ``PATH``, ``HOME``, ``TMPDIR``, ...).
  ``value.binary`` must be false (a zip is no spec); ``value.main`` is ignored. The worker
  then registers the spec's model and attaches to a pool (the composition root's
  ``prepare``) and builds its engine; 200 ``{"ok": true}``. A failed init may be retried;
  once one succeeded, another ``/init`` is refused with 403, as OpenWhisk's own runtimes do.
* ``/run`` body ``{"value": PARAMS, "namespace", "action_name", "activation_id",
  "deadline", ...}``. Every field but ``value`` becomes ``__OW_<FIELD>`` in ``os.environ``
  for the activation (and in the handler's ``context.env``); ``deadline`` (epoch
  milliseconds) is the handler's ``context.remaining_time()``, and an activation whose
  deadline has passed when its turn comes is refused (400) without running. ``PARAMS`` is the event: for
  the default handler a chat (``messages``) or completion (``prompt``) request, answered
  with the OpenAI JSON body (no streaming: an activation's result is one JSON object); for a
  custom handler the handler's result, which must be a JSON object (an async generator's
  items are collected under ``events``). Errors are ``{"error": "..."}`` with 400 (bad
  params), 502 (the function's code failed, or it returned no object), 503 (no KV room) or
  500. Activations are serialized; at the end of each the engine returns its KV blocks to
  the pool (OpenWhisk pauses an idle container) and ``XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX``
  is printed on stdout and stderr (also after a failed ``/init``).

There is no Ember credential on this interface: ``/init`` and ``/run`` are the invoker's,
and the container must be reachable by the invoker only (OpenWhisk's container network).
Bodies are bounded (:class:`runtime.worker_guard.BodyLimit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.assignment import assign
from runtime.drain import Lifecycle, listen, serve_draining
from runtime.engine.scheduler import KVCacheExhausted, RequestFailed
from runtime.errors import EmberRuntimeError, route_error
from runtime.intra_op import claim_engine_thread
from runtime.messages import AssignMessage
from runtime.openai_api import CompletionRequest, RequestError, parse_request_async
from runtime.openai_response import completion_body
from runtime.openai_tools import tool_message
from runtime.worker_guard import BodyLimit
from runtime.worker_state import WorkerState

SENTINEL = "XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX"
PORT = 8080  # OpenWhisk reaches a blackbox action's container on 8080
DEFAULT_DEADLINE_S = 60.0  # OpenWhisk's default action time limit, for a /run without a deadline
MAX_FIELDS = 32  # fields of a /run message besides value (OpenWhisk sends about eight)
MAX_TEXT = 4096  # characters of one field or environment value
MAX_ENV = 256  # variables in /init's value.env
MAX_CODE_CHARS = 1 << 20  # a spec document is a few KiB
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_RESERVED_ENV = ("EMBER_", "__OW_")
# Variables that change what this process and its children load or run (the dynamic loader,
# glibc, the interpreter, the executable search path): the container's, not the action's.
_LOADER_ENV = ("LD_", "GLIBC_", "MALLOC_", "PYTHON")
_LOADER_NAMES = frozenset({"PATH", "HOME", "TMPDIR", "SHELL", "IFS", "ENV", "BASH_ENV"})

log = logging.getLogger("ember.openwhisk")


class ActionError(EmberRuntimeError):
    """A refused /init or /run: ``status`` is the HTTP status of the ``{"error"}`` reply."""

    code = "action_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _message(raw: bytes) -> dict[str, Any]:
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ActionError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ActionError(400, "the body must be a JSON object")
    return message


def _text(value: Any, what: str) -> str:
    """An environment value: strings as they are, other JSON as JSON text (as OpenWhisk's proxies)."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_TEXT or "\0" in text:
        raise ActionError(400, f"{what} must be at most {MAX_TEXT} characters, without NUL")
    return text


@dataclass(frozen=True, slots=True)
class InitValue:
    """What ``/init``'s ``value`` carries for Ember (see the module docstring)."""

    code: str | None  # the function spec document (YAML or JSON text)
    env: dict[str, str] = field(default_factory=dict)
    name: str | None = None  # the action's name, when OpenWhisk gives it

    @classmethod
    def from_body(cls, raw: bytes) -> InitValue:
        """The value of an ``/init`` body; :class:`ActionError` (400) if it is not one."""
        value = _message(raw).get("value", {})
        if not isinstance(value, dict):
            raise ActionError(400, "value must be a JSON object")
        if value.get("binary"):
            raise ActionError(400, "value.code must be a function spec document, not an archive")
        code = value.get("code")
        if code is not None and (not isinstance(code, str) or len(code) > MAX_CODE_CHARS):
            raise ActionError(400, f"value.code must be text of at most {MAX_CODE_CHARS} characters")
        env = value.get("env") or {}
        if not isinstance(env, dict) or len(env) > MAX_ENV:
            raise ActionError(400, f"value.env must be a mapping of at most {MAX_ENV} variables")
        variables = {}
        for key, item in env.items():
            upper = key.upper()
            if (
                not _ENV_NAME.match(key)
                or upper.startswith(_RESERVED_ENV + _LOADER_ENV)
                or upper in _LOADER_NAMES
            ):
                raise ActionError(400, f"value.env: {key[:64]!r} is not a name an action may set")
            variables[key] = _text(item, f"value.env.{key}")
        name = value.get("name")
        return cls(code or None, variables, _text(name, "value.name") if isinstance(name, str) else None)


@dataclass(frozen=True, slots=True)
class Activation:
    """One ``/run``: the handler's event, its ``__OW_*`` environment, id and deadline."""

    params: dict[str, Any]
    env: dict[str, str]
    activation_id: str
    deadline: float  # epoch seconds

    @classmethod
    def from_body(cls, raw: bytes, now: float) -> Activation:
        """The activation in a ``/run`` body; :class:`ActionError` (400) if it is not one."""
        message = _message(raw)
        params = message.pop("value", {})
        if not isinstance(params, dict):
            raise ActionError(400, "value (the activation's parameters) must be a JSON object")
        if len(message) > MAX_FIELDS:
            raise ActionError(400, f"a /run message has at most {MAX_FIELDS} fields besides value")
        env = {}
        for key, item in message.items():
            if not _FIELD.match(key):
                raise ActionError(400, f"{key[:64]!r} is not a field name")
            env[f"__OW_{key.upper()}"] = _text(item, key)
        deadline = now + DEFAULT_DEADLINE_S
        if "deadline" in message:
            try:
                millis = float(message["deadline"])
            except (TypeError, ValueError):
                raise ActionError(400, "deadline must be epoch milliseconds") from None
            if not math.isfinite(millis) or millis <= 0:
                raise ActionError(400, "deadline must be epoch milliseconds")
            deadline = millis / 1000.0
            if deadline <= now:
                # Passed already (or while it waited for the activation before it): the invoker
                # has given up on it, so the engine's time goes to the next one instead.
                raise ActionError(400, f"the activation's deadline passed {now - deadline:.3f} s ago")
        activation_id = env.get("__OW_ACTIVATION_ID") or uuid.uuid4().hex
        return cls(params, env, activation_id, deadline)


Prepare = Callable[[InitValue], AssignMessage]  # blocking: parse the spec, register, find the pool


@dataclass
class ActionState:
    """The action's worker and where its initialization stands."""

    worker: WorkerState = field(default_factory=WorkerState)
    initialized: bool = False
    initializing: bool = False
    running: asyncio.Lock = field(default_factory=asyncio.Lock)  # activations do not overlap


def _reply(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def end_of_activation() -> None:
    """OpenWhisk reads an activation's logs up to this marker, on both streams."""
    for stream in (sys.stdout, sys.stderr):
        stream.write(SENTINEL + "\n")
        stream.flush()


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (activations are serialized: no other sees them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


async def _init(action: ActionState, raw: bytes, prepare: Prepare) -> dict[str, Any]:
    value = InitValue.from_body(raw)
    with _environment(value.env):  # undone if this /init fails: a retry brings its own
        result = await _initialize(action, value, prepare)
    os.environ.update(value.env)  # the action's, for every activation from now on
    return result


async def _initialize(action: ActionState, value: InitValue, prepare: Prepare) -> dict[str, Any]:
    try:
        message = await asyncio.to_thread(prepare, value)
    except (EmberRuntimeError, ValueError, OSError, KeyError) as exc:
        raise ActionError(502, f"the action cannot be initialized: {exc}") from None
    try:
        action.worker.assignment, _ = await assign(action.worker, message)
    except (EmberRuntimeError, ValueError, OSError, KeyError) as exc:
        raise ActionError(502, f"the action cannot be initialized: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # the handler's own initializer failed
        raise ActionError(502, f"the function's initializer failed: {type(exc).__name__}: {exc}") from None
    log.info("initialized: function %s, model %s, pool %s", message.spec["metadata"]["name"],
             message.model_dir, message.pool_socket)  # fmt: skip
    return {"ok": True}


async def _activate(action: ActionState, activation: Activation) -> dict[str, Any]:
    a = action.worker.assignment
    assert a is not None
    params = activation.params
    if a.runner is None:  # the default handler: a chat or a completion request
        if ("messages" in params) == ("prompt" in params):
            raise ActionError(400, "the parameters need exactly one of 'messages' or 'prompt'")
        if params.get("stream"):
            raise ActionError(400, "stream: an OpenWhisk activation's result is one JSON object")
        chat = "messages" in params
        try:
            request = await parse_request_async(params, chat)
            # prepare_all, as on /v1/chat/completions: response_format and tools are honoured
            # (constrained decoding, calls read back), never accepted and then ignored.
            prepared = await a.binding.prepare_all(request)
            done = await a.binding.complete(
                prepared.ids, prepared.params, request.n, prepared.constraints, prepared.adapter
            )
        except RequestError as exc:
            raise ActionError(400, str(exc)) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{activation.activation_id}"
        echo = request.prompt if isinstance(request, CompletionRequest) and request.echo else None
        body = completion_body(rid, a.name, chat, done, echo)
        return tool_message(body, prepared.plan) if prepared.calls_tools and prepared.plan else body
    try:
        result = await a.runner.invoke(params, activation.activation_id, activation.deadline, activation.env)
        if hasattr(result, "__aiter__"):
            result = {"events": [item async for item in result]}
    except RequestError as exc:
        raise ActionError(400, str(exc)) from None
    except RequestFailed:
        raise
    except Exception as exc:  # the function's own code failed
        a.runner.logger.exception("activation %s failed", activation.activation_id)
        raise ActionError(502, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(result, dict):
        raise ActionError(502, "the action did not return a JSON object")
    return result


def _release_kv(action: ActionState) -> None:
    """Return the engine's free KV blocks to the pool (none is in use between activations)."""
    a = action.worker.assignment
    if a is not None and not a.binding.engine.has_unfinished():
        a.binding.engine.blocks.trim(0)


def build_openwhisk_app(action: ActionState, prepare: Prepare) -> FastAPI:
    """The FastAPI app of ``/init`` and ``/run`` (and ``/healthz``), see the module docstring."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            action.worker.close()

    # No /docs or /openapi.json: the invoker needs none, and nothing here carries a credential.
    app = FastAPI(
        title="ember openwhisk action", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_exception_handler(StarletteHTTPException, route_error)  # 404/405 in Ember's error body

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "initialized": action.initialized}

    @app.post("/init")
    async def init(raw: Request) -> Any:
        if action.initialized or action.initializing:
            log.warning("a second /init was refused")
            return _reply(403, {"error": "Cannot initialize the action more than once."})
        action.initializing = True
        try:
            body = await _init(action, await raw.body(), prepare)
            action.initialized = True
            return body
        except ActionError as exc:
            log.error("/init failed: %s", exc)
            end_of_activation()
            return _reply(exc.status, {"error": str(exc)})
        finally:
            action.initializing = False

    @app.post("/run")
    async def run(raw: Request) -> Any:
        body = await raw.body()
        async with action.running:
            try:
                if not action.initialized:
                    raise ActionError(502, "the action is not initialized (POST /init first)")
                activation = Activation.from_body(body, time.time())
                with _environment(activation.env):
                    result = await _activate(action, activation)
                try:
                    text = json.dumps(result, allow_nan=False)
                except (TypeError, ValueError, RecursionError) as exc:
                    raise ActionError(502, f"the action's result is not JSON: {exc}") from None
                return Response(text, media_type="application/json")
            except ActionError as exc:
                return _reply(exc.status, {"error": str(exc)})
            except KVCacheExhausted as exc:
                return _reply(503, {"error": str(exc)})
            except RequestFailed as exc:
                return _reply(500, {"error": str(exc)})
            finally:
                _release_kv(action)
                end_of_activation()

    return app


def serve(
    prepare: Prepare,
    host: str = "0.0.0.0",
    port: int = PORT,
    max_body_bytes: int = 4 << 20,
    grace_s: float = 10.0,
) -> int:
    """Serve the action until SIGTERM; the process's exit code."""
    import uvloop

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    claim_engine_thread()  # before any pool thread starts (runtime.intra_op)
    action = ActionState()
    app = BodyLimit(build_openwhisk_app(action, prepare), max_body_bytes)
    sock = listen(host, port)
    log.info("OpenWhisk action interface on %s:%d", host, port)
    try:
        return uvloop.run(serve_draining(app, sock, grace_s, Lifecycle()))
    finally:
        action.worker.close()
