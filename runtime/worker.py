"""A worker process: pre-warmed first, then one function instance serving over HTTP.

A pre-warmed worker (TIDAL's process pool) has torch and the runtime imported, its HTTP
server listening and the templates of registered models loaded (tokenizer, chat template,
profile), but no function. ``POST /_ember/assign`` turns it into an instance: it confines
itself to its function's code (:mod:`runtime.function_sandbox`; a worker serves one function
for its life), attaches to its device's pool, binds the model to the pool's tensor views
(resident tensors are not copied), builds the engine from the materialized profile and, for a
custom handler, runs its static initializer. It then serves OpenAI-compatible
``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE with ``usage``) and ``/invoke``
(the function's handler). ``POST /_ember/standby`` prepares a pre-warmed worker for one
function ahead of time, and the assign that follows activates it (:mod:`runtime.assignment`).
A request that names the instance being assigned is held until the assign ends
(:mod:`runtime.early_requests`).
On SIGTERM the server drains, the engine returns its KV blocks and the pool session closes,
so the weights stay resident, inactive, for the next instance.

Every route but ``/healthz`` requires the worker's own credential and bodies are bounded
(:mod:`runtime.worker_guard`); request headers are bounded in read time and size, and
malformed requests answered with a JSON error, by the server the gateway runs too
(:mod:`runtime.http_server`). Prompts beyond a small size are tokenized in a thread with the
GIL released, and ones far beyond the context are rejected before tokenizing
(:meth:`ModelBinding.prepare`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpu_pool.errors import PoolError
from runtime.assignment import Assignment, StandbyMismatch, activate, assign, prepare
from runtime.core_spread import unpin
from runtime.early_requests import INSTANCE_HEADER, Share, release_at_first_output
from runtime.engine.engine import Engine, HangUp
from runtime.engine.scheduler import RequestFailed
from runtime.errors import EmberRuntimeError, InstanceLost, PoolLost, route_error
from runtime.function_sandbox import ConfinedElsewhere, FunctionSandbox
from runtime.http_server import HeaderLimits, server_config
from runtime.instance import ModelBinding, Prepared
from runtime.intra_op import claim_engine_thread, set_engine_threads
from runtime.messages import AssignMessage, MessageError, PreloadMessage, StandbyMessage, ThreadsMessage
from runtime.openai_api import ChatRequest, CompletionRequest, RequestError, parse_request_async
from runtime.openai_response import collect, completion_body, sse_chunks, sse_event
from runtime.openai_tool_stream import tool_sse_chunks
from runtime.openai_tools import tool_message
from runtime.process import collection_paused
from runtime.rehearsal import rehearse
from runtime.sandbox import FunctionLayer, SandboxError
from runtime.server_timing import ServerTiming
from runtime.worker_answers import (
    HangUpStreamingResponse,
    bad_request,
    error_answer,
    failed_answer,
    json_body,
    never_ran,
)
from runtime.worker_guard import AUTHORIZED, GuardConfig, WorkerGuard
from runtime.worker_state import WorkerState

DEFAULT_HANDLER = "default"
# Idle keep-alive of the worker's connections (s): longer than the gateway's pool keeps an
# idle connection (gateway.proxy, 30 s), so the gateway never sends a request on a
# connection the worker has just closed (such a request could not be told apart from one
# the worker received and then failed on, and is never re-sent).
KEEP_ALIVE_S = 75


class Ahead(NamedTuple):
    """A request read before its instance's activation ended (``build_app``'s ``ahead``): its
    parsed form and, when it could be, its preparation with the standby's ``binding``."""

    body: Any
    request: ChatRequest | CompletionRequest
    binding: ModelBinding | None  # None: not prepared (the instance prepares it)
    prepared: Prepared | None


class Served(NamedTuple):
    """The instance a request is served by, and its share of the activation's handover (a
    request the worker held: :mod:`runtime.early_requests`)."""

    assignment: Assignment
    share: Share | None


async def _prefetch_kv(engine: Engine) -> None:
    """A new instance's first KV blocks (:meth:`Engine.scale_kv`: the watermark's), on the event
    loop like every other call on its pool session."""
    engine.scale_kv()


def build_app(state: WorkerState) -> FastAPI:
    """The FastAPI app of a worker (pre-warmed until assigned); :func:`serve` wraps it in
    :class:`WorkerGuard`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="ember worker", lifespan=lifespan)
    app.add_exception_handler(StarletteHTTPException, route_error)  # 404/405 in Ember's error body
    app.add_middleware(ServerTiming)

    @app.get("/healthz")
    async def healthz(raw: Request) -> dict[str, Any]:
        if not raw.scope.get(AUTHORIZED, False):
            return {"status": "ok"}  # liveness only: what it serves is for the credential's holder
        a = state.assignment
        if a is None:
            ready = {"status": "ok", "templates": sorted(state.templates)}
            if state.standby is not None:
                return {**ready, "state": "standby", "function": state.standby.name}
            return {**ready, "state": "idle"}
        import torch

        model = a.binding.template.model.model_id
        return {
            "status": "ok",
            "state": "serving",
            "function": a.name,
            "instance_id": a.instance_id,
            "model": model,
            "num_threads": torch.get_num_threads(),  # intra-op threads (the agent's share of the cores)
            "num_sequences": len(a.binding.engine.seqs),  # requests' choices the engine holds now
        }

    @app.post("/_ember/preload")
    async def preload(raw: Request) -> Any:
        try:
            message = PreloadMessage.from_json(await raw.body())
            await asyncio.to_thread(state.template, message.model_dir, True)
        except (KeyError, TypeError, ValueError, EmberRuntimeError, OSError) as exc:
            return error_answer(400, "preload_failed", f"{type(exc).__name__}: {exc}")
        return {"templates": sorted(state.templates)}

    @app.post("/_ember/threads")
    async def threads(raw: Request) -> Any:
        """Set this instance's intra-op threads (the agent shares a CPU device's cores among
        its instances: oversubscribed OpenMP threads spin against each other)."""
        import torch

        try:
            message = ThreadsMessage.from_json(await raw.body())
        except MessageError as exc:
            return error_answer(400, "invalid_request_error", str(exc))
        set_engine_threads(message.num_threads)  # this (event-loop) thread steps the engine
        return {"num_threads": torch.get_num_threads()}

    async def assign_body(body: bytes, serving: Callable[[], None] | None = None) -> Response:
        """An assign (its JSON ``body``), from ``/_ember/assign`` or the agent's control line
        (:mod:`runtime.control_line`), which gives ``serving``: it tells the agent that the
        assign took and the instance serves, before the reply."""

        async def become() -> Response:
            unpin(state.cores)  # a standby's main thread, pinned while its assign woke it
            try:
                message = AssignMessage.from_json(body)
                standby, state.standby = state.standby, None
                if standby is None:
                    state.assignment, reply = await assign(state, message)
                else:
                    state.activating = standby
                    try:
                        state.assignment, reply = await activate(standby, message, state.pool_lost)
                    except StandbyMismatch:
                        state.standby = standby  # untouched: the agent ends this worker
                        raise
                    finally:
                        state.activating = None
                if state.lost_while_assigning:  # its pool died meanwhile (WorkerState.release)
                    state.release()
                    raise PoolLost(f"the pool daemon went away while instance {message.instance_id} started")
            except BaseException:  # the agent ends this worker: it holds no request from now on
                if body:  # (not the rehearsal's empty body: runtime.rehearsal)
                    state.early.refuse()
                raise
            state.released = None
            state.schedule_tokens(message)
            # The requests held for this assign go first: this reply is not on their path, only
            # on the agent's way to recording the instance ready. For the default handler it
            # waits for their first outputs (runtime.early_requests.Handover); a custom
            # handler's requests are its own code's, of unknown length: one loop turn.
            handover = state.early.ended()
            await asyncio.sleep(0)
            a = state.assignment
            # Only over the control line, which tells the agent first that the instance serves
            # (over HTTP, a worker that exits before its reply would be a failed start to it);
            # and not when the agent's token scheduler admits and steps it: the agent attaches
            # this instance to its grants only on the reply, so its requests wait for it.
            said_serving = False
            if serving is not None and a is not None and a.runner is None and a.binding.engine.gate is None:
                if handover.num_pending:
                    serving()
                    said_serving = True
                waited_s = await handover.wait()
                reply = replace(reply, timings_ms={**reply.timings_ms, "handover_wait_ms": waited_s * 1e3})
                a = state.assignment
            if a is None and said_serving:  # it served, then its pool died: the instance is lost
                why = f"the pool daemon went away while instance {message.instance_id} served"
                return error_answer(503, InstanceLost.code, why)
            if a is None:  # its pool died meanwhile (WorkerState.release)
                raise PoolLost(f"the pool daemon went away while instance {message.instance_id} started")
            # The KV blocks a next request would fetch from the pool (a round trip on its path,
            # ~0.5 ms) are fetched once this reply is out, while it travels to the gateway. Not
            # for a custom handler: it may never run the model, and would hold them for nothing.
            prefetch = BackgroundTask(_prefetch_kv, a.binding.engine) if a.runner is None else None
            return Response(reply.to_json(), media_type="application/json", background=prefetch)

        # A standby's activation for the default handler is a few ms on a request's path: no
        # collection until its reply (a custom handler's initializer, the function's own code,
        # may run for long).
        standby = state.standby
        with collection_paused(standby is not None and standby.handler is None):
            return await _assigning(become)

    @app.post("/_ember/assign")
    async def assign_route(raw: Request) -> Any:
        return await assign_body(await raw.body())

    async def assign_line(
        body: bytes, serving: Callable[[], None]
    ) -> tuple[int, bytes, Callable[[], Awaitable[None]] | None]:
        response = await assign_body(body, serving)
        return response.status_code, bytes(response.body), response.background

    app.state.assign_line = assign_line  # serve() gives it to the control line

    @app.post("/_ember/standby")
    async def standby_route(raw: Request) -> Any:
        async def prepared() -> Response:
            state.standby, reply = await prepare(state, StandbyMessage.from_json(await raw.body()))
            if state.lost_while_assigning:  # its pool died meanwhile (WorkerState.release)
                state.release()
                raise PoolLost("the pool daemon went away while the standby was prepared")
            return Response(reply.to_json(), media_type="application/json")

        return await _assigning(prepared)

    async def _assigning(step: Callable[[], Awaitable[Response]]) -> Response:
        """Run an assign or a standby's preparation, one at a time, its errors as JSON."""
        if state.assignment is not None or state.assigning:
            return error_answer(409, "already_assigned", "this worker already serves a function")
        state.assigning, state.lost_while_assigning = True, False
        try:
            return await step()
        except (ConfinedElsewhere, StandbyMismatch) as exc:
            return error_answer(409, exc.code, str(exc))
        except SandboxError as exc:  # the function's layer could not be stacked: not its code's fault
            return error_answer(500, exc.code, str(exc))
        except PoolError as exc:  # the pool refused (no room, not resident) or went away
            return error_answer(503, exc.code, f"the pool: {exc}")
        except PoolLost as exc:
            return error_answer(503, exc.code, str(exc))
        except (KeyError, TypeError, ValueError, EmberRuntimeError, OSError) as exc:
            return error_answer(400, "assign_failed", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # the handler's own initializer failed: a function error
            return error_answer(500, "function_init_failed", f"{type(exc).__name__}: {exc}")
        finally:
            state.assigning = False
            state.early.ended()

    async def serving(raw: Request) -> Served | JSONResponse:
        """The instance to serve ``raw`` with: a request sent before the activation of the
        instance it names ended waits for it (:mod:`runtime.early_requests`), and then holds
        a share of the activation's handover (the caller releases it)."""
        a = state.assignment
        instance_id = raw.headers.get(INSTANCE_HEADER)
        released = state.released
        if a is None and released is not None and instance_id in (None, released):
            return _ended(released)  # its pool died (WorkerState.release): routed again
        if instance_id is None:
            if a is None:
                return error_answer(409, "not_assigned", "this worker serves no function yet")
            return Served(a, None)
        share = None
        if a is None:
            share = await state.early.hold_share(raw.headers.get("x-ember-deadline"))
            a = state.assignment if share is not None else None
        if a is None or a.instance_id != instance_id:
            if share is not None:
                share.release()
            why = f"instance {instance_id} did not start here; the request never ran"
            return never_ran(instance_id, why)
        return Served(a, share)

    def _ended(instance_id: str) -> JSONResponse:
        return never_ran(instance_id, f"instance {instance_id} ended with its pool; the request never ran")

    async def ahead(raw: Request, chat: bool) -> Ahead | JSONResponse | None:
        """A request sent ahead of its instance's activation to a standby of the default
        handler is read, parsed and tokenized with the standby's binding while the activation
        runs (its pool round trip leaves the loop free), not after it. None: not such a
        request. A client mistake is answered at once (it would be on any instance); a
        failure that may depend on the activation (an adapter it attaches) leaves the
        preparation to :func:`openai`."""
        standby = state.standby or state.activating
        if state.assignment is not None or standby is None or standby.handler is not None:
            return None
        # Only a request the worker would hold: one it is about to refuse costs nothing here.
        deadline = raw.headers.get("x-ember-deadline")
        if INSTANCE_HEADER not in raw.headers or not state.early.can_hold(deadline):
            return None
        with state.early.reading():  # counted as held (MAX_HELD) while it is prepared
            body = await json_body(raw)
            if isinstance(body, JSONResponse):
                return body
            try:
                request = await parse_request_async(body, chat)
            except RequestError as exc:
                return bad_request(exc)
            binding = standby.binding
            try:
                prepared = await binding.prepare_all(request)
            except Exception:  # an activation may close this binding meanwhile
                # Prepared again after the hold, with the instance's binding: a real error is
                # raised there (a RequestError here may name an adapter the activation attaches).
                return Ahead(body, request, None, None)
            return Ahead(body, request, binding, prepared)

    async def openai(raw: Request, chat: bool, body: Any = None, share: Share | None = None) -> Any:
        """A chat or completion request (``body``: its JSON read already, by ``/invoke``, which
        hands on its ``share`` of an activation's handover)."""
        early = await ahead(raw, chat) if body is None else None
        if isinstance(early, JSONResponse):
            return early
        served = await serving(raw)
        if isinstance(served, JSONResponse):
            return served
        share = share if share is not None else served.share
        try:
            return await _openai(raw, chat, body, early, served.assignment, share)
        finally:
            if share is not None:  # unless its streams took it (released at their first output)
                share.release()

    async def _openai(
        raw: Request, chat: bool, body: Any, early: Ahead | None, a: Assignment, share: Share | None
    ) -> Any:
        if early is not None:
            body = early.body
        elif body is None:
            body = await json_body(raw)
            if isinstance(body, JSONResponse):
                return body
        try:
            if early is not None and early.binding is a.binding:  # the standby's engine serves it
                request, prepared = early.request, early.prepared
                assert prepared is not None
            else:
                request = early.request if early is not None else await parse_request_async(body, chat)
                prepared = await a.binding.prepare_all(request)
        except RequestError as exc:
            return bad_request(exc)
        ids, params = prepared.ids, prepared.params
        try:  # the device's token scheduler admits it (runtime.mesh), before any byte is sent
            arrival = await a.binding.engine.admit(len(ids), request.n)
        except RequestFailed as exc:
            return failed_answer(exc)
        if state.assignment is not a:  # it ended with its pool meanwhile (WorkerState.release)
            return _ended(a.instance_id)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        echo = request.prompt if isinstance(request, CompletionRequest) and request.echo else None
        hang_up = HangUp()
        streams = a.binding.streams(
            ids,
            params,
            request.n,
            prepared.constraints,
            arrival,
            prepared.adapter,
            hang_up if request.stream else None,
        )
        reporter = a.binding.reporter(params)
        if share is not None:
            streams = release_at_first_output(streams, share.transfer())
        if request.stream:
            if prepared.plan is not None and prepared.calls_tools:  # one choice (prepare_all)
                chunks = tool_sse_chunks(
                    streams[0],
                    rid,
                    a.name,
                    len(ids),
                    prepared.plan,
                    request.include_usage,
                    request.continuous_usage,
                )
            else:
                chunks = sse_chunks(
                    streams,
                    rid,
                    a.name,
                    chat,
                    ids,
                    request.include_usage,
                    reporter,
                    echo,
                    request.continuous_usage,
                )
            return HangUpStreamingResponse(chunks, hang_up, media_type="text/event-stream")
        try:
            done = await collect(streams, ids, reporter)
        except RequestFailed as exc:
            return failed_answer(exc)
        body = completion_body(rid, a.name, chat, done, echo)
        return (
            tool_message(body, prepared.plan) if prepared.plan is not None and prepared.calls_tools else body
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Any:
        return await openai(raw, chat=True)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        return await openai(raw, chat=False)

    @app.post("/invoke")
    async def invoke(raw: Request) -> Any:
        served = await serving(raw)
        if isinstance(served, JSONResponse):
            return served
        a, share = served
        try:
            return await _invoke(raw, a, share)
        finally:
            if share is not None:  # unless the default handler's streams took it
                share.release()

    async def _invoke(raw: Request, a: Assignment, share: Share | None) -> Any:
        event = await json_body(raw)
        if isinstance(event, JSONResponse):
            return event
        if state.assignment is not a:  # it ended with its pool meanwhile (WorkerState.release)
            return _ended(a.instance_id)
        if a.runner is None:  # the default handler: an event is a chat or a completion request
            if not isinstance(event, dict) or ("messages" in event) == ("prompt" in event):
                return error_answer(
                    400, "invalid_request_error", "the event needs exactly one of 'messages' or 'prompt'"
                )
            return await openai(raw, chat="messages" in event, body=event, share=share)
        rid = raw.headers.get("x-ember-request-id") or uuid.uuid4().hex
        deadline = float(raw.headers.get("x-ember-deadline") or time.time() + 300)
        try:
            result = await a.runner.invoke(event, rid, deadline)
        except RequestError as exc:
            return bad_request(exc)
        except RequestFailed as exc:
            return failed_answer(exc)
        except Exception as exc:  # the function's own code failed
            a.runner.logger.exception("request %s failed", rid)
            return error_answer(500, "function_error", f"{type(exc).__name__}: {exc}")
        if hasattr(result, "__aiter__"):

            async def events() -> AsyncIterator[bytes]:
                async for item in result:
                    yield sse_event(item)
                yield sse_event("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(result)

    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    preload: list[str] | None = None,
    assignment: AssignMessage | None = None,
    premap: list[str] | None = None,
    guard: GuardConfig | None = None,
    show_token: bool = False,
    headers: HeaderLimits | None = None,
    function_layer: FunctionLayer | None = None,
    mesh_fd: int | None = None,
    mesh_page_fd: int | None = None,
    survive_pool_loss: bool = False,
    control_fd: int | None = None,
) -> None:
    """Run a worker until SIGTERM; prints one JSON readiness line with its URL on stdout.

    ``preload`` lists model directories whose templates are loaded before readiness;
    ``assignment`` (an ``/_ember/assign`` message) makes it an instance before readiness;
    ``premap`` lists pool sockets whose arenas are mapped and pre-faulted before readiness.
    ``guard`` holds the worker's credential and body bound (required: a worker never serves
    without one); ``show_token`` adds the credential to the readiness line (for a worker
    started from the CLI, whose caller did not choose it). ``headers`` bounds each request's
    line and headers (default: :class:`HeaderLimits`' defaults). ``function_layer`` (a sandboxed
    worker's) confines the worker to its function's code when it is assigned. ``mesh_fd``: this
    worker's end of a socketpair with its agent's token scheduler (:mod:`runtime.mesh`);
    ``mesh_page_fd``: the memfd of the page it publishes its requests in for the agent.
    ``survive_pool_loss``: when its pool dies, the instance ends but the process stays
    (:meth:`WorkerState.pool_lost`), for an agent that starts the function on it again.
    ``control_fd``: this worker's end of its agent's control line (:mod:`runtime.control_line`).
    """
    if guard is None:
        raise ValueError("a worker needs a GuardConfig (its credential)")
    import uvicorn

    # Handlers' context.logger and the runtime log to stderr: the agent keeps it as the instance's log.
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    claim_engine_thread()  # before any pool thread starts (runtime.intra_op)
    state = WorkerState(sandbox=FunctionSandbox(function_layer), survive_pool_loss=survive_pool_loss)
    if mesh_fd is not None:
        state.mesh_sock = socket.socket(fileno=mesh_fd)
    if mesh_page_fd is not None:
        import mmap

        from runtime.mesh.state_page import PAGE_BYTES

        state.mesh_page = mmap.mmap(mesh_page_fd, PAGE_BYTES)
        os.close(mesh_page_fd)
    from gpu_pool.client import premap as map_arena

    for model_dir in preload or []:
        state.template(model_dir, warm=True)
    for pool_socket in premap or []:
        state.mapped[pool_socket] = map_arena(pool_socket)
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only for it (else ~40 ms Nagle stalls per response).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    inner = build_app(state)
    line = None
    if control_fd is not None:
        from runtime.control_line import LineServer

        os.set_inheritable(control_fd, False)  # not the function's subprocesses' (the agent sees EOF)
        line = LineServer(socket.socket(fileno=control_fd), inner.state.assign_line)
    app = WorkerGuard(inner, guard)
    config = server_config(
        app, headers or HeaderLimits(), log_level="warning", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S
    )
    server = uvicorn.Server(config)
    ready: dict[str, Any] = {"event": "ready", "url": url, "pid": os.getpid()}
    if show_token:
        ready["token"] = guard.token

    async def main() -> None:
        state.loop = asyncio.get_running_loop()
        state.sandbox.install(state.loop)  # before anything runs in a thread
        await rehearse(inner)  # the request path's lazy imports and first calls, off the cold path
        if line is not None:
            line.start()
        if assignment is not None:
            state.assignment, _ = await assign(state, assignment)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                await task
            await asyncio.sleep(0.005)
        print(json.dumps(ready), flush=True)
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # later prints go to the log, not the pipe
        await task

    import uvloop

    try:
        uvloop.run(main())
    finally:
        state.close()
