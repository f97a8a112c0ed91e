"""Composition root: the one place where Ember's long-lived components are built and wired.

Every other module receives its collaborators (a :class:`ClusterState`, a :class:`NodeAgent`,
a :class:`Router`, ...) as arguments and builds none itself, so tests can assemble any subset
from real parts. Here the embedded mode's graph is put together: Redis (embedded and supervised,
or external), the node agent (pool daemons + pre-warmed workers), the router and its reconcile
loop, the invoker, metrics, readiness and the gateway app. :mod:`gateway.serve` owns what the
process does with it (the lock on ``EMBER_HOME``, the listening socket, signals, ``serve.json``);
the ``ember worker`` verb gets its standalone assignment from :func:`standalone_assignment`.

Cluster mode's gateway (``ember gateway``, :mod:`gateway.cluster_gateway`) is built by
:func:`build_cluster`: the same app over an external Redis, with each function's Knative
Service in place of the router's instances. :func:`knative_manifests` renders a spec file for
``ember deploy --target knative`` without a gateway or a cluster.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.app import AdapterRegistrar, GatewayConfig, ModelSourceError, Registrar, Serving, create_app
from gateway.function_code import FunctionCodeConfig
from gateway.health import Readiness
from gateway.limits import DeployLimits, EdgeLimits
from gateway.metrics import Metrics
from gateway.proxy import Invoker, ProxyConfig
from gateway.storage import storage_full

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gateway.cluster_gateway import ClusterGatewayConfig
    from gateway.serve import ServeConfig
    from runtime.agent import NodeAgent
    from runtime.messages import AssignMessage
    from runtime.supervisor import SpawnThread
    from scheduler.knative.deployments import KnativeDeployments
    from scheduler.knative.handler_code import HandlerCode
    from scheduler.knative.render import Rendered
    from scheduler.records import FunctionRecord, ModelRef
    from scheduler.redis_server import EmbeddedRedis
    from scheduler.router import Router
    from scheduler.state import ClusterState

Background = Callable[[], Coroutine[Any, Any, None]]
EXTENDER_PREFIX = "/extender"  # where ember-scheduler's KubeSchedulerConfiguration points


@dataclass
class EmbeddedNode:
    """The embedded mode's components, wired; :meth:`start` before serving ``app``, then
    :meth:`close` (always, also when :meth:`start` failed half-way)."""

    gateway_config: GatewayConfig
    state: ClusterState
    agent: NodeAgent
    router: Router
    invoker: Invoker
    metrics: Metrics
    app: FastAPI
    redis_server: EmbeddedRedis | None
    spawner: SpawnThread  # the thread supervised children are (re)started from

    async def start(self) -> None:
        """Forget the previous run's instances, adopt registered models, start pools and workers."""
        device = self.agent.device_id("cpu")
        await asyncio.to_thread(_forget_stale_instances, self.state, [device])
        for record in await asyncio.to_thread(lambda: list(self.state.functions().values())):
            if record.model is not None:
                self.agent.adopt_template(record.model.dir)
        await self.agent.start()

    async def close(self) -> None:
        """Stop everything :func:`build_embedded` started, dependents first."""
        await self.router.close()
        await self.invoker.close()
        await self.agent.close()
        self.state.close()
        if self.redis_server is not None:
            await asyncio.to_thread(self.redis_server.stop)
        await asyncio.to_thread(self.spawner.close)


def build_embedded(config: ServeConfig, api_key: str | None) -> EmbeddedNode:
    """Build (and for Redis, start) the embedded mode's components from ``config``.

    The embedded redis-server starts here, from the calling thread, so that the supervisor's
    restarts fork from a long-lived thread too (see :func:`runtime.process.die_with_parent`).
    """
    from runtime.agent import AgentConfig, NodeAgent
    from runtime.mesh.config import TokenSchedulingConfig
    from runtime.process import die_with_parent
    from runtime.sandbox import SandboxConfig
    from runtime.supervisor import RestartConfig, SpawnThread, ThreadRestarted, supervise
    from runtime.worker_limits import WorkerLimits
    from scheduler.redis_server import EmbeddedRedis
    from scheduler.router import Router, RouterConfig
    from scheduler.state import ClusterState

    gateway_config = GatewayConfig(
        api_key=api_key,
        logs_dir=config.home / "logs",
        code=FunctionCodeConfig.from_env(config.home),
        limits=EdgeLimits.from_env(),
        deploy=DeployLimits.from_env(),
    )
    restart = RestartConfig.from_env()
    spawner = SpawnThread("ember-redis-spawn")
    background: list[Background] = []
    redis_server = None
    if config.redis_url is None:
        redis_server = EmbeddedRedis(config.home / "redis", preexec_fn=die_with_parent())
        redis_server.start()
        child = ThreadRestarted("redis-server", redis_server, spawner)
        background.append(lambda: supervise(child, restart))
        background.append(redis_server.keep_synced)
    try:
        if redis_server is None:
            assert config.redis_url is not None
            state = ClusterState.from_url(config.redis_url)
        else:  # its records are fsynced on write (scheduler.durable)
            state = ClusterState.from_url(redis_server.url, sync_records=redis_server.sync_files)
    except BaseException:
        if redis_server is not None:
            redis_server.stop()
        spawner.close()
        raise
    agent = NodeAgent(
        AgentConfig(
            home=config.home,
            arena_bytes=config.arena_bytes,
            prewarm=config.prewarm,
            standby=config.standby,
            survivor_keep_s=config.survivor_keep_s,
            node=config.node,
            restart=restart,
            sandbox=SandboxConfig.from_env(),
            limits=WorkerLimits.from_env(),
            tokens=TokenSchedulingConfig.from_env(),
        ),
        report=state.report_device,
    )
    metrics = Metrics(devices=state.devices)
    router = Router(
        state,
        agent,
        RouterConfig.from_env(),
        on_start=lambda name, s: metrics.instance_started(
            name, s.bytes_loaded, s.bytes_reused, s.timings_ms.get("assign_ms", 0.0) / 1e3
        ),
    )
    invoker = Invoker(state, router, metrics, ProxyConfig(request_timeout_s=config.request_timeout_s))
    agent.on_standby(invoker.preconnect)  # the request sent ahead of an activation finds a connection
    router.on_records(invoker.records_read)  # a request after idle reads no record from Redis
    serving = Serving(
        _registrar(agent),
        router,
        invoker,
        metrics,
        [router.run, *background],
        Readiness(state.r.ping, agent.pools_alive, agent.warm_ready),
        agent.evict,
        register_adapters=_adapter_registrar(agent.config.home),
    )
    app = create_app(state, gateway_config, serving)
    return EmbeddedNode(gateway_config, state, agent, router, invoker, metrics, app, redis_server, spawner)


def _registrar(agent: NodeAgent) -> Registrar:
    """Model registration for the gateway's deploy route: the agent registers, errors are 400s."""
    from runtime.errors import EmberRuntimeError

    async def register(source: str, dtype: str) -> dict[str, Any]:
        print(f"ember serve: registering {source} ({dtype})", file=sys.stderr, flush=True)
        try:
            model = await agent.ensure_model(source, dtype, progress=True)
        except (EmberRuntimeError, ValueError, OSError) as exc:
            raise _source_error(exc, "spec.model.source") from None
        print(f"ember serve: model {model['id']} ready", file=sys.stderr, flush=True)
        return model

    return register


def _source_error(exc: BaseException, field: str) -> Exception:
    """What a failed registration of ``field``'s model is to the client: a full disk is the
    server's (507, :mod:`gateway.storage`), anything else the source's (400 naming ``field``)."""
    return storage_full(exc, f"the model of {field}") or ModelSourceError(f"{field}: {exc}")


def _adapter_registrar(home: Path) -> AdapterRegistrar:
    """LoRA adapter registration for the deploy route (:mod:`runtime.adapters`), errors 400s
    naming the adapter. Adapters are stored in the base's activation dtype."""
    from runtime.adapters import register_adapter
    from runtime.errors import EmberRuntimeError
    from runtime.registry import load

    async def register(adapters: list[tuple[str, str]], dtype: str, base_dir: str) -> dict[str, str]:
        lora_dtype = "float32" if dtype == "float32" else "bfloat16"
        base = (await asyncio.to_thread(load, Path(base_dir))).config  # adapters must fit it
        out = {}
        for i, (name, source) in enumerate(adapters):
            try:
                adapter = await asyncio.to_thread(register_adapter, source, lora_dtype, home, None, base)
            except (EmberRuntimeError, ValueError, OSError) as exc:
                raise _source_error(exc, f"spec.model.adapters.{i}.source") from None
            out[name] = str(adapter.directory)
        return out

    return register


@dataclass
class ClusterNode:
    """Cluster mode's gateway components, wired; :meth:`close` when done."""

    gateway_config: GatewayConfig
    state: ClusterState
    deployments: KnativeDeployments
    invoker: Invoker
    metrics: Metrics
    app: FastAPI

    async def close(self) -> None:
        await self.invoker.close()
        await asyncio.to_thread(self.deployments.close)
        self.state.close()


def _stored_code(config: FunctionCodeConfig, record: FunctionRecord) -> HandlerCode:
    """The custom handler module the gateway stored for ``record`` (to render its ConfigMap)."""
    from gateway.function_code import read_stored

    return read_stored(config, record.function_id, record.handler)


def build_cluster(config: ClusterGatewayConfig) -> ClusterNode:
    """Cluster mode's gateway over ``config.redis_url``: deploys and deletes apply Knative
    Services (:mod:`scheduler.knative`), invocations go to their cluster-local URLs. Call it on
    the running event loop (the invoker's connection pool belongs to it)."""
    from gateway.extender import extender_app, extender_for
    from scheduler.knative.backend import make_backend
    from scheduler.knative.deployments import KnativeDeployments
    from scheduler.knative.targets import ServiceTargets
    from scheduler.state import ClusterState

    # Uploaded handler modules are kept here, then rendered as ConfigMaps for the pods.
    code = FunctionCodeConfig.from_env(config.home)
    gateway_config = GatewayConfig(api_key=config.api_key, limits=EdgeLimits.from_env(), code=code)
    backend = make_backend(config.knative)  # no Kubernetes credentials: fail now, not at the first deploy
    try:
        state = ClusterState.from_url(config.redis_url)
    except BaseException:
        backend.close()
        raise
    read_code = functools.partial(_stored_code, code)
    deployments = KnativeDeployments(config.knative, config.tokens, backend, read_code)
    targets = ServiceTargets(config.knative, config.tokens)
    metrics = Metrics(devices=state.devices)
    invoker = Invoker(state, targets, metrics, ProxyConfig(request_timeout_s=config.request_timeout_s))
    serving = Serving(
        _store_registrar(config.home),
        targets,
        invoker,
        metrics,
        readiness=Readiness(state.r.ping),
        deployments=deployments,
    )
    app = create_app(state, gateway_config, serving)
    # ember-scheduler's extender calls (kube-scheduler sends no API key: a NetworkPolicy keeps
    # them in the cluster; they reveal only which nodes hold which models).
    extender = extender_for(state, config.extender)
    app.mount(EXTENDER_PREFIX, extender_app(extender, gateway_config.limits, ping=state.r.ping))
    return ClusterNode(gateway_config, state, deployments, invoker, metrics, app)


def _store_registrar(home: Path) -> Registrar:
    """Cluster mode's model registration: into this process's model store (no agent, no pool)."""
    from runtime.errors import EmberRuntimeError
    from runtime.registry import register

    async def registrar(source: str, dtype: str) -> dict[str, Any]:
        print(f"ember gateway: registering {source} ({dtype})", file=sys.stderr, flush=True)
        try:
            model = await asyncio.to_thread(register, source, dtype, home)
            manifest = await asyncio.to_thread(model.manifest)
        except (EmberRuntimeError, ValueError, OSError) as exc:
            raise _source_error(exc, "spec.model.source") from None
        return {"id": model.model_id, "dir": str(model.directory), "weight_bytes": int(manifest.nbytes)}

    return registrar


@dataclass(frozen=True, slots=True)
class KnativeManifests:
    """``ember deploy --target knative``'s output: the objects (their ``notes`` say where the
    rendering differs from the spec) and what to warn about."""

    rendered: Rendered
    warnings: tuple[str, ...]


def knative_manifests(document: Any, home: Path, spec_file: Path | None = None) -> KnativeManifests:
    """Render a spec document locally: no gateway, no cluster. The model's id and weight bytes
    come from the local model store when the model is registered there (matched by source and
    dtype, the newest registration first); otherwise they are left out, with a warning. A
    custom handler's module is read from beside ``spec_file`` (its ConfigMap is rendered too).
    Raises :class:`scheduler.spec.SpecError`, :class:`ValueError` (bad ``EMBER_KNATIVE_*``, a
    module that cannot be read) and :class:`OSError` (a missing module)."""
    from gateway.function_code import local_handler_code
    from scheduler import names
    from scheduler.knative.config import KnativeConfig
    from scheduler.knative.render import render_record
    from scheduler.records import FunctionRecord
    from scheduler.spec import parse_function

    spec = parse_function(document)
    function_id = names.qualified(spec.metadata.namespace, spec.name)
    model = registered_model(spec.spec.model.source, spec.spec.model.dtype, home)
    code = local_handler_code(document, spec_file) if spec_file is not None else None
    rendered = render_record(
        FunctionRecord.create(function_id, spec.to_document(), model), KnativeConfig.from_env(), code
    )
    warnings = []
    if model is None:
        warnings.append(
            f"model {spec.spec.model.source} ({spec.spec.model.dtype}) is not registered in {home}: "
            f"rendered without the ember.dev/model and ember.dev/weight-bytes annotations, so the "
            f"scheduler extender cannot score residency for this function (deploying through "
            f"`ember gateway` registers the model and adds them)"
        )
    return KnativeManifests(rendered, tuple(warnings))


def registered_model(source: str, dtype: str, home: Path) -> ModelRef | None:
    """The local model store's registration of ``source`` in ``dtype`` (None: not registered)."""
    from runtime.errors import EmberRuntimeError
    from runtime.registry import list_models
    from scheduler.records import ModelRef

    try:
        candidates = [
            m
            for m in list_models(home)
            if m.record.get("source") == source.strip() and m.record.get("dtype") == dtype
        ]
        if not candidates:
            return None
        newest = max(candidates, key=lambda m: m.directory.stat().st_mtime)
        return ModelRef(newest.model_id, str(newest.directory), int(newest.manifest().nbytes))
    except (EmberRuntimeError, OSError, ValueError):  # an unreadable store: as if not registered
        return None


def _forget_stale_instances(state: ClusterState, devices: list[str]) -> None:
    """A fresh agent runs nothing: instance records on its devices are from a previous run."""
    for name in state.functions_with_instances():
        for inst in state.instances(name):
            if inst.device in devices:
                state.forget_instance(name, inst.instance_id)


def standalone_assignment(name: str, model_dir: Path, pool_socket: str) -> AssignMessage:
    """``ember worker``'s assignment: the default handler over one registered model, outside
    any ``ember serve`` (no pool ticket: a session without KV quota)."""
    import time

    from runtime.messages import AssignMessage
    from runtime.registry import load
    from scheduler.spec import parse_function

    model = load(model_dir)
    spec = parse_function(
        {"apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": name},
         "spec": {"model": {"source": model.record["source"], "dtype": model.record["dtype"]}}}
    ).to_document()  # fmt: skip
    return AssignMessage("0", spec, str(model_dir), pool_socket, None, time.time() + 300)


# ----- cluster mode: the worker in a function pod, and as an OpenWhisk action -----------------

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.pod_instance import PodInstanceRecord
    from runtime.knative_worker import KnativeConfig
    from runtime.openwhisk import InitValue
    from runtime.worker_guard import GuardConfig

WORKER_TOKEN_ENV = "EMBER_WORKER_TOKEN"  # the worker's credential in a function pod (a Secret)
FUNCTION_SPEC_ENV = "EMBER_FUNCTION_SPEC"  # an OpenWhisk image's own spec, for an /init without code
INIT_TIMEOUT_S = 300.0  # a handler's static initializer must finish within this
MAX_HANDLER_REF = 512  # characters of EMBER_FUNCTION_HANDLER


@dataclass(frozen=True)
class KnativeWorker:
    """``ember worker --function ID``'s parts (:func:`runtime.knative_worker.serve` takes them)."""

    config: KnativeConfig
    assignment: AssignMessage
    guard: GuardConfig
    record: PodInstanceRecord


def build_knative_worker(function_id: str, env: Mapping[str, str], max_body_bytes: int) -> KnativeWorker:
    """Read function ``function_id``'s record from Redis and record this pod's instance.

    ``env`` is the pod's environment: ``EMBER_WORKER_TOKEN`` and ``EMBER_REDIS_URL`` (with
    ``EMBER_REDIS_PASSWORD`` joined in, :mod:`gateway.redis_auth`) and ``EMBER_NODE_NAME``
    are required; the pool is ``$EMBER_POOL_DIR/cpu.sock``; :class:`KnativeConfig` reads the
    rest. A custom handler's module is the revision's own, mounted from its ConfigMap:
    ``EMBER_FUNCTION_HANDLER`` (:func:`pod_handler`) replaces the record's handler, which is a
    path on the gateway. ValueError for a bad or missing setting or an unregistered model; the
    scheduler's errors for Redis (:class:`~scheduler.errors.FunctionNotFound` when it is not
    deployed).
    """
    import re
    import time

    from gateway.pod_instance import PodInstanceRecord
    from gateway.redis_auth import PASSWORD_ENV, with_password
    from runtime.knative_worker import KnativeConfig
    from runtime.messages import AssignMessage
    from runtime.worker_guard import GuardConfig
    from scheduler import cluster_keys, names
    from scheduler.knative import handler_code
    from scheduler.state import ClusterState

    namespace, name = names.split(function_id)
    if not (names.is_label(namespace) and names.is_label(name)):
        raise ValueError(f"--function {function_id!r} is not a function id (NAME or NAMESPACE/NAME)")
    token = env.get(WORKER_TOKEN_ENV, "")
    if not token:
        raise ValueError(f"{WORKER_TOKEN_ENV} is required: the credential the gateway calls this worker with")
    guard = GuardConfig.from_env(token, max_body_bytes)
    config = KnativeConfig.from_env(env)
    handler = pod_handler(function_id, env.get(handler_code.HANDLER_ENV, ""))
    node = env.get(cluster_keys.NODE_NAME_ENV, "").strip()
    if len(node) > 253 or not re.fullmatch(r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?", node):  # a DNS subdomain
        raise ValueError(f"{cluster_keys.NODE_NAME_ENV} must be the pod's node name (downward API)")
    url = with_password(env.get("EMBER_REDIS_URL") or None, env.get(PASSWORD_ENV) or None)
    if url is None:
        raise ValueError("EMBER_REDIS_URL is required: the cluster state holds the function's record")
    pool_dir = Path(env.get(cluster_keys.POOL_DIR_ENV) or cluster_keys.DEFAULT_POOL_DIR)
    state = ClusterState.from_url(url)
    try:
        record = state.function(function_id)
        if record.model is None:
            raise ValueError(f"function {function_id!r}: its model is not registered yet")
        instance = PodInstanceRecord.create(
            state, function_id, cluster_keys.device_id(node), config.record_ttl_s
        )
    except BaseException:
        state.close()
        raise
    spec = record.spec
    if handler is not None:
        spec = {**spec, "spec": {**spec["spec"], "handler": handler}}
    try:
        assignment = AssignMessage(
            instance.instance_id,
            spec,
            record.model.dir,
            str(pool_dir / cluster_keys.CPU_SOCKET),
            None,  # no ticket: the node's pool gives sessions without one its session KV quota
            time.time() + config.pool_wait_s + INIT_TIMEOUT_S,
        )
    except BaseException:
        instance.gone()
        raise
    return KnativeWorker(config, assignment, guard, instance)


def pod_handler(function_id: str, value: str) -> str | None:
    """The absolute handler reference of a pod's ``EMBER_FUNCTION_HANDLER``
    (``NAMESPACE/NAME/<digest>/module.py:function`` under the functions root, in the function's
    own directory: :mod:`scheduler.knative.handler_code`); None when unset. ValueError else."""
    from runtime.sdk.handler import functions_root
    from scheduler import names
    from scheduler.knative.handler_code import HANDLER_ENV, split_ref

    if not value:
        return None
    module_text, _, function = value.rpartition(":")
    parts = module_text.split("/")
    digest = parts[2] if len(parts) == 4 else ""
    try:
        split_ref(value)
        named = True
    except ValueError:
        named = False
    if not named or len(value) > MAX_HANDLER_REF or not (digest.isascii() and digest.isalnum()) or (
        tuple(parts[:2]) != names.split(function_id)
    ):  # fmt: skip
        raise ValueError(
            f"{HANDLER_ENV} must be NAMESPACE/NAME/DIGEST/module.py:function in {function_id}'s own "
            f"directory, got {value[:200]!r}"
        )
    return f"{functions_root().joinpath(*parts)}:{function}"


@dataclass(frozen=True)
class OpenWhiskWorker:
    """``ember worker --openwhisk``'s parts: ``prepare`` for ``/init``, ``close`` at exit."""

    prepare: Callable[[InitValue], AssignMessage]
    pool_socket: str
    close: Callable[[], None]  # stops the private pool daemon, when there is one


def build_openwhisk_worker(env: Mapping[str, str]) -> OpenWhiskWorker:
    """The node's pool when ``$EMBER_POOL_DIR/cpu.sock`` exists, else a private pool daemon
    started here (arena ``EMBER_ARENA``, default 2 GiB) trusting ``EMBER_HOME/models``,
    where ``/init`` registers the spec's model (``pkg:`` sources resolve inside the image).
    With the node's pool, ``EMBER_HOME`` must be the node's model store, which it trusts.
    Call from a long-lived thread (the private pool gets SIGTERM when it ends)."""
    import shutil
    import tempfile

    from gpu_pool.config import parse_size
    from gpu_pool.spawn import PoolProcess
    from runtime.process import die_with_parent
    from runtime.registry import models_dir
    from scheduler import cluster_keys

    home = Path(env.get("EMBER_HOME") or Path.home() / ".ember").expanduser()
    node_socket = Path(env.get(cluster_keys.POOL_DIR_ENV) or cluster_keys.DEFAULT_POOL_DIR)
    node_socket /= cluster_keys.CPU_SOCKET
    spec_file = env.get(FUNCTION_SPEC_ENV) or None
    if node_socket.is_socket():
        pool_socket, close = str(node_socket), lambda: None
    else:
        arena = parse_size(env.get("EMBER_ARENA") or "2GiB", "EMBER_ARENA")
        store = models_dir(home)
        store.mkdir(parents=True, exist_ok=True)
        run_dir = tempfile.mkdtemp(prefix="ember-pool-")  # short: a socket path has 108 bytes
        try:
            pool = PoolProcess(
                f"{run_dir}/cpu.sock", arena, "cpu", (), {"EMBER_POOL_PREFAULT": "false"},
                die_with_parent(), log_path=f"{run_dir}/pool.log", store_roots=(store,),
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        pool_socket = pool.socket_path

        def close() -> None:
            pool.stop()
            shutil.rmtree(run_dir, ignore_errors=True)

    def prepare(value: InitValue) -> AssignMessage:
        return _openwhisk_assignment(value, home, pool_socket, spec_file)

    return OpenWhiskWorker(prepare, pool_socket, close)


def _openwhisk_assignment(
    value: InitValue, home: Path, pool_socket: str, spec_file: str | None
) -> AssignMessage:
    """``/init``'s spec, its model and LoRA adapters registered under ``home``: the action's assignment."""
    import time

    from runtime.adapters import register_adapter
    from runtime.messages import AssignMessage
    from runtime.registry import register
    from scheduler.spec import parse_function_yaml

    text = value.code
    if text is None and spec_file is not None:
        text = Path(spec_file).read_text()
    if text is None:
        raise ValueError(f"value.code must carry the function spec (or the image set {FUNCTION_SPEC_ENV})")
    document = parse_function_yaml(text).to_document()
    body = document["spec"]
    module, _, function = body["handler"].rpartition(":")
    if module:  # a module of the image's function code, relative to its functions directory
        functions = home / "functions"
        path = Path(module) if Path(module).is_absolute() else functions / module
        # /init's spec is the action creator's, not the image's: it must not load any other
        # Python file the image holds (a "../" or an absolute path) as the action's code.
        if not path.resolve().is_relative_to(functions.resolve()):
            raise ValueError(f"handler {module!r} is not a module under the image's {functions}")
        body["handler"] = f"{path}:{function}"
    model = register(body["model"]["source"], body["model"]["dtype"], home=home)
    lora_dtype = "float32" if body["model"]["dtype"] == "float32" else "bfloat16"
    adapters = {
        a["name"]: str(register_adapter(a["source"], lora_dtype, home, None, model.config).directory)
        for a in body["model"]["adapters"]
    }
    deadline = time.time() + INIT_TIMEOUT_S
    instance_id = value.name or "openwhisk"
    return AssignMessage(
        instance_id, document, str(model.directory), pool_socket, None, deadline, adapters=adapters
    )


# ----- cluster mode: the node daemon (the pool DaemonSet) --------------------------------------


async def run_node(env: Mapping[str, str], stop: asyncio.Event | None = None) -> None:
    """``ember node``: the node's supervised pool daemons, reporting residency to the cluster's
    Redis (``EMBER_REDIS_URL``, ``EMBER_REDIS_PASSWORD`` joined in) until SIGTERM/SIGINT or
    ``stop``. ValueError for a bad or missing setting."""
    import signal

    from gateway.redis_auth import PASSWORD_ENV, with_password
    from runtime.node_daemon import NodeConfig, NodeDaemon, WantedModel
    from scheduler.state import ClusterState

    config = NodeConfig.from_env(env)
    url = with_password(env.get("EMBER_REDIS_URL") or None, env.get(PASSWORD_ENV) or None)
    if url is None:
        raise ValueError("EMBER_REDIS_URL is required: the node reports its pools' residency there")
    os.umask(0o077)  # the pool's log; its socket's mode is the pool's own choice
    state = ClusterState.from_url(url)

    def wanted() -> list[WantedModel]:
        models = {}
        for record in state.functions().values():
            if record.model is not None:
                models[record.model.model_id] = WantedModel(
                    record.model_source, record.model_dtype, record.model.model_id
                )
        return list(models.values())

    daemon = NodeDaemon(config, state.report_device, wanted)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await daemon.start()
        print(
            json.dumps({"event": "ready", "node": config.node, "pool_dir": str(config.pool_dir)}), flush=True
        )
        await daemon.run(stop)
    finally:
        await daemon.close()
        state.close()
