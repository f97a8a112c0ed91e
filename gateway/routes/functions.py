"""Function routes: deploy, list, describe, delete, logs and the OpenAI ``/v1/models`` list.

Each acts in one namespace: a tenant's own, or the admin's ``?namespace=`` (default:
"default"); another tenant's function is a 404 like a missing one. A namespace holds at most
``EMBER_MAX_FUNCTIONS_PER_NAMESPACE`` functions (:class:`gateway.limits.DeployLimits`): a
deploy of a new one beyond it is 409 ``function_quota_exceeded``. Specs are parsed and
validated off the event loop (CPU work for large bodies); handlers that only read Redis are
plain functions, which FastAPI runs in its thread pool, so a Redis restart (retried for
seconds) never stalls the event loop and its streams.

In cluster mode (``serving.deployments``) a function is also a Knative Service: a deploy
checks that Knative can express the spec before storing it, stores it (workers read it from
Redis when they start), then creates or updates the Service; if that fails, the previous
record is put back (or the new one removed) and the failure is answered. A delete removes
the Service first, then the record (a failed delete can be retried); describe and list add
each function's ``status.knative`` (its Service's readiness).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from gateway.errors import ModelSourceError
from gateway.function_code import split_upload, store_handler
from gateway.limits import JSONError, load_json
from gateway.tenants import Principal
from scheduler import names
from scheduler.errors import FunctionNotFound, StoredNotDurable
from scheduler.records import FunctionRecord, ModelRef
from scheduler.spec import FunctionSpec, SpecError, parse_function, parse_function_yaml
from scheduler.state import ClusterState

if TYPE_CHECKING:  # gateway.app composes this module
    from gateway.app import GatewayConfig, Serving


def function_routes(
    state: ClusterState,
    config: GatewayConfig,
    serving: Serving | None,
    authorize: Callable[[Request], Awaitable[Principal]],
) -> APIRouter:
    """The function routes over ``state``; with ``serving``, deploys register the model and
    redeploys or deletes retire the running instances."""
    router = APIRouter()
    caller = Depends(authorize)  # who: Principal = caller (a local alias: annotations are strings)

    @router.post("/v1/functions", status_code=201)
    async def deploy(request: Request, who: Principal = caller) -> dict[str, Any]:
        raw = (await request.body()).decode("utf-8", errors="replace")  # bounded: BodyLimits
        # Parsing and validating a spec of up to max_spec_bytes is CPU work: off the event loop.
        spec, files = await asyncio.to_thread(_parse_spec, raw, request.headers.get("content-type", ""))
        spec = who.place(spec)  # a tenant's own namespace; 403 for another
        function_id = names.qualified(spec.metadata.namespace, spec.name)
        caps = (config.deploy.max_functions_per_namespace, config.deploy.max_min_scale_per_namespace)
        # A full namespace is refused before the handler is stored and the model registered;
        # put_function below checks again, atomically (concurrent deploys).
        await asyncio.to_thread(state.check_room, function_id, caps[0], spec.to_document(), caps[1])
        deployments = serving.deployments if serving is not None else None
        if deployments is not None:  # a spec Knative cannot express: 400 before anything is stored
            await asyncio.to_thread(deployments.check, FunctionRecord.create(function_id, spec.to_document()))
        handler = await asyncio.to_thread(store_handler, config.code, function_id, spec.spec.handler, files)
        model = None
        if serving is not None:
            registered = await serving.register(spec.spec.model.source, spec.spec.model.dtype)
            if spec.spec.model.adapters:
                if serving.register_adapters is None:
                    raise ModelSourceError("spec.model.adapters: LoRA adapters are not served in this mode")
                pairs = [(a.name, a.source) for a in spec.spec.model.adapters]
                base_dir = str(registered["dir"])  # each adapter must fit it: checked now, not per start
                adapters = await serving.register_adapters(pairs, spec.spec.model.dtype, base_dir)
                registered = {**registered, "adapters": adapters}
            model = ModelRef.decode(registered)
        document = spec.to_document()
        document["spec"]["handler"] = handler  # an uploaded module's stored path
        try:
            previous: FunctionRecord | None = await asyncio.to_thread(state.function, function_id)
        except FunctionNotFound:
            previous = None
        # Stored but not confirmed on disk: the deploy's other effects still happen, then the
        # client is told (503) and may repeat it (scheduler.durable).
        not_durable: StoredNotDurable | None = None
        try:
            await asyncio.to_thread(state.put_function, function_id, document, model, *caps)
        except StoredNotDurable as exc:
            not_durable = exc
        if deployments is not None:
            record = FunctionRecord.create(function_id, document, model)
            try:
                await asyncio.to_thread(deployments.apply, record)
            except Exception:  # a deploy whose Service could not be applied changes nothing
                await asyncio.to_thread(_restore, state, function_id, previous)
                if serving is not None:  # a request meanwhile may have cached the record undone
                    serving.invoker.forget(function_id)
                raise
        if serving is not None:
            serving.invoker.forget(function_id)
            if previous is not None and (previous.spec, previous.model) != (document, model):
                await serving.router.retire(function_id)  # running instances serve the old version
        if not_durable is not None:
            raise not_durable
        return document

    def in_namespace(who: Principal, namespace: str | None) -> dict[str, dict[str, Any]]:
        scope = who.scope(namespace)
        return {i: f for i, f in state.list_functions().items() if names.split(i)[0] == scope}

    def with_status(documents: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The documents, with ``status.knative`` in cluster mode (copies: the stored
        documents are never changed)."""
        if serving is None or serving.deployments is None or not documents:
            return list(documents.values())
        statuses = serving.deployments.statuses(list(documents))
        return [{**doc, "status": {"knative": statuses[i]}} for i, doc in documents.items()]

    @router.get("/v1/functions")
    def list_functions(who: Principal = caller, namespace: str | None = None) -> dict[str, Any]:
        return {"functions": with_status(in_namespace(who, namespace))}

    @router.get("/v1/functions/{name}")
    def describe(name: str, who: Principal = caller, namespace: str | None = None) -> dict[str, Any]:
        function_id = who.function(name, namespace)
        return with_status({function_id: state.get_function(function_id)})[0]

    @router.delete("/v1/functions/{name}", status_code=204)
    async def delete(name: str, who: Principal = caller, namespace: str | None = None) -> Response:
        name = who.function(name, namespace)
        await asyncio.to_thread(state.function, name)  # 404 for unknown functions, before anything
        if serving is not None and serving.deployments is not None:
            await asyncio.to_thread(serving.deployments.remove, name)
        not_durable: StoredNotDurable | None = None  # deleted, not confirmed on disk: as in deploy
        try:
            await asyncio.to_thread(state.delete_function, name)
        except FunctionNotFound:  # deleted since the check (a concurrent delete, or a write run
            pass  # again after a lost connection): the rest of the delete still happens
        except StoredNotDurable as exc:
            not_durable = exc
        if config.code is not None:
            await asyncio.to_thread(config.code.remove, name)
        if serving is not None:
            serving.invoker.forget(name)
            await serving.router.retire(name)
        if not_durable is not None:
            raise not_durable
        return Response(status_code=204)

    @router.get("/v1/functions/{name}/logs")
    def logs(
        name: str, tail: int = 200, who: Principal = caller, namespace: str | None = None
    ) -> PlainTextResponse:
        name = who.function(name, namespace)  # "ns/name": the directory functions/ns/name
        state.get_function(name)  # 404 for unknown functions
        directory = (config.logs_dir / "functions" / name) if config.logs_dir else None
        if directory is None or not directory.is_dir():
            return PlainTextResponse("")
        files = sorted(directory.glob("instance-*.log"), key=lambda p: p.stat().st_mtime)
        lines: list[str] = []
        for path in files:
            text = path.read_text(errors="replace").splitlines()
            lines += [f"[{path.stem}] {line}" for line in text]
        return PlainTextResponse("\n".join(lines[-max(1, min(tail, 10_000)) :]) + "\n")

    @router.get("/v1/models")
    def models(who: Principal = caller, namespace: str | None = None) -> dict[str, Any]:
        now = int(time.time())
        data = [
            {"id": names.split(i)[1], "object": "model", "created": now, "owned_by": "ember"}
            for i in in_namespace(who, namespace)
        ]
        return {"object": "list", "data": data}

    return router


def _restore(state: ClusterState, function_id: str, previous: FunctionRecord | None) -> None:
    """Put back the record a failed deploy replaced (none: remove the new one)."""
    if previous is None:
        state.delete_function(function_id)
    else:
        state.put_function(function_id, previous.spec, previous.model)


def _parse_spec(raw: str, content_type: str) -> tuple[FunctionSpec, dict[str, str]]:
    """A function spec from a deploy body, depth-bounded: JSON (by content type, optionally with
    the handler's uploaded module: :func:`gateway.function_code.split_upload`) or YAML."""
    if "json" in content_type:
        try:
            data, files = split_upload(load_json(raw))
        except JSONError as exc:
            raise SpecError(f"malformed JSON: {exc}") from None
        return parse_function(data), files
    return parse_function_yaml(raw), {}
