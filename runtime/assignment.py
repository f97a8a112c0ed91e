"""Turning a worker into an instance: at once (:func:`assign`), or ahead of time (a standby).

:func:`assign` confines the worker to its function's code (:mod:`runtime.function_sandbox`),
attaches to its device's pool, binds the model to the pool's tensor views (resident tensors
are not copied), builds the engine from the materialized profile and, for a custom handler,
runs its initializer.

A *standby* is a pre-warmed worker the agent prepared for one function after that function's
instance ended (:mod:`runtime.standby_pool`): :func:`prepare` does every step of an assign
that needs no instance — the sandbox layer, the template, the pool session (its ticket's KV
quota), the weights' views, the engine, its first KV blocks (with the function's most recent
prompt prefix in them), the handler's import, the session's watch (the pool's death ends
it) — and then releases the weights. A standby pins no weights: its model stays an inactive
resident the pool may evict or move like any other. :func:`activate` finishes the start
when the assign comes: one acquire in the same session, and the engine is kept when the pool
returns the same placements (the views point at the same bytes, now pinned) or rebuilt on the
new ones. The handler's initializer runs at activation, as in an assign, and the activation
reports the acquire it made, so a start from a standby is accounted like any other (bytes
loaded, bytes reused).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from runtime.engine.kv_storage import PoolBlockSource
from runtime.errors import EmberRuntimeError
from runtime.instance import ModelBinding, ModelTemplate, bind, bind_at, load_adapters
from runtime.intra_op import set_engine_threads
from runtime.messages import AssignMessage, AssignReply, StandbyMessage, StandbyReply
from runtime.process import set_idle_priority
from runtime.sdk import LLM, HandlerRunner, load_handler

if TYPE_CHECKING:
    from gpu_pool.client import PrefixPrefetch
    from runtime.function_sandbox import FunctionSandbox
    from runtime.sdk.handler import LoadedHandler

DEFAULT_HANDLER = "default"
# The most prefix KV an activation asks the pool for with its weights (bytes). It is a guess
# (the prefix the function's last new instance restored first): a right one saves the first
# request's restore round trip (~1-2 ms on a 2-core host), a wrong one costs the copy (~0.3 ms
# per MiB into fresh pages there), so it stays a few MiB: 11 blocks of SmolLM2-135M (176 tokens).
PREFIX_PREFETCH_BYTES = 4 << 20

log = logging.getLogger("ember.worker")


class StandbyMismatch(EmberRuntimeError):
    """An assign for another function, model or pool session than the standby prepared."""

    code = "standby_mismatch"


@dataclass
class Assignment:
    """The function this worker serves and what serves it."""

    instance_id: str
    spec: dict[str, Any]
    binding: ModelBinding
    client: Any  # gpu_pool.client.PoolClient
    runner: HandlerRunner | None  # None for the default (chat/completions) handler
    driver: asyncio.Task[None]

    @property
    def name(self) -> str:
        return str(self.spec["metadata"]["name"])


@dataclass
class Standby:
    """A worker prepared for one function (see the module docstring)."""

    message: StandbyMessage
    binding: ModelBinding
    client: Any  # gpu_pool.client.PoolClient: the session, open, holding no pins
    placements: dict[str, int]  # where the views point (arena offsets by tensor name)
    handler: LoadedHandler | None  # imported; its initializer runs at activation

    @property
    def name(self) -> str:
        return str(self.message.spec["metadata"]["name"])

    def close(self) -> None:
        self.binding.engine.close()
        self.client.close()


class Workspace(Protocol):
    """What :func:`assign` and :func:`prepare` need of the worker's state."""

    sandbox: FunctionSandbox
    mapped: dict[str, Any]  # pool socket -> gpu_pool.client.MappedArena
    templates: dict[str, ModelTemplate]

    def template(self, model_dir: str, warm: bool = False) -> ModelTemplate: ...

    def pool_lost(self) -> None:
        """Called from a pool session's watch thread when its pool daemon is gone."""


def pool_lost() -> None:
    """A worker's own reaction to its pool's death when nobody reuses it (a standalone or a
    pod's worker): drain and exit; it is started again on the restarted pool."""
    log.error("the pool daemon went away: draining and exiting")
    os.kill(os.getpid(), signal.SIGTERM)


def weights_lost() -> None:
    """Called when the progressive load of this instance's weights failed after it started:
    the pool dropped the tensors, every forward would fail. Like :func:`pool_lost`: drain and
    exit; the agent starts the function again, on a new acquire."""
    log.error("the weights failed to load: draining and exiting")
    os.kill(os.getpid(), signal.SIGTERM)


async def _template(state: Workspace, model_dir: str) -> ModelTemplate:
    template = state.templates.get(model_dir)
    if template is None:
        template = await asyncio.to_thread(state.template, model_dir)
    return template


def _session(state: Workspace, socket_path: str, ticket: str | None) -> Any:
    """A pool session with ``ticket``'s KV quota, on the arena this worker premapped."""
    from gpu_pool.client import PoolClient

    premapped = state.mapped.get(socket_path)
    client = PoolClient(socket_path, mapped=premapped, ticket=ticket)
    if premapped is not None and premapped.handle != client.arena_handle:
        # A restarted pool's new arena: drop the old mapping, which alone keeps the old
        # arena's memory alive.
        del state.mapped[socket_path]
    return client


def _threads(num_threads: int | None) -> None:
    if num_threads is not None:
        set_engine_threads(num_threads)  # on the event loop's thread, which steps the engine


def _import_handler(ref: str) -> LoadedHandler | None:
    """The function's handler module, imported (None: the default handler). Before the pool
    session opens: a module that fails to import leaves nothing to close."""
    return None if ref == DEFAULT_HANDLER else load_handler(ref)


async def _serve(
    message: AssignMessage,
    binding: ModelBinding,
    client: Any,
    handler: LoadedHandler | None,
    on_pool_lost: Callable[[], None],
) -> Assignment:
    """Start serving: watch the pool, drive the engine, run the handler's initializer (a custom
    handler's). On failure the binding and the session are closed."""
    # An instance whose pool died cannot allocate KV or trust its weights' residency: it ends
    # (``on_pool_lost``: :meth:`Workspace.pool_lost`) and is started again on the restarted
    # pool. A standby's session is watched since its preparation.
    if not client.watched:
        client.watch(on_pool_lost)
    loop = asyncio.get_running_loop()
    driver = asyncio.create_task(binding.engine.run_forever())  # steps the engine between requests
    runner = None
    try:
        if handler is not None:
            runner = HandlerRunner(handler, message.spec, LLM(binding, loop))
            await runner.setup(message.deadline)
    except BaseException:
        driver.cancel()
        binding.engine.close()
        client.close()
        raise
    return Assignment(message.instance_id, message.spec, binding, client, runner, driver)


async def assign(state: Workspace, message: AssignMessage) -> tuple[Assignment, AssignReply]:
    """Become instance ``message.instance_id`` of ``message.spec``'s function in one step."""
    t0 = time.perf_counter()
    # First: the threads this assignment starts (the pool's watch thread, the thread pool's
    # new threads) are then born under the function's sandbox layer.
    await state.sandbox.confine(message.spec)
    t_sandbox = time.perf_counter()
    set_idle_priority(False)
    _threads(message.num_threads)
    template = await _template(state, message.model_dir)
    t_template = time.perf_counter()
    handler = _import_handler(message.handler)

    def attach() -> tuple[ModelBinding, Any]:
        # The ticket (granted by the agent, the pool's admin) gives this session its KV quota.
        client = _session(state, message.pool_socket, message.pool_ticket)
        try:
            adapters = load_adapters(tuple(message.adapters.items()))
            binding = bind(
                template,
                client,
                message.max_tokens,
                message.kv_quota_bytes,
                adapters,
                on_load_failed=weights_lost,
            )
            return binding, client
        except BaseException:
            client.close()
            raise

    binding, client = await asyncio.to_thread(attach)
    assignment = await _serve(message, binding, client, handler, state.pool_lost)
    timings = {
        "sandbox_ms": (t_sandbox - t0) * 1e3,
        "template_ms": (t_template - t_sandbox) * 1e3,
        **binding.timings_ms,
    }
    timings["assign_ms"] = (time.perf_counter() - t0) * 1e3
    return assignment, AssignReply(message.instance_id, timings, binding.acquire_report)


async def prepare(state: Workspace, message: StandbyMessage) -> tuple[Standby, StandbyReply]:
    """Prepare a standby for ``message.spec``'s function (see the module docstring);
    ``gpu_pool.errors.NotResident`` when its model is not all resident (a standby loads
    nothing). The worker stays at idle priority: this is background work."""
    t0 = time.perf_counter()
    await state.sandbox.confine(message.spec)
    template = await _template(state, message.model_dir)
    handler = _import_handler(message.handler)

    def attach() -> tuple[ModelBinding, Any, dict[str, int]]:
        client = _session(state, message.pool_socket, message.pool_ticket)
        try:
            # Not a request (uncounted), and it never loads: one for a model the pool evicted
            # meanwhile would bring its bytes back (evicting others) for a start that may never
            # come. The pool fails it with NotResident instead.
            placements = client.acquire_placements(template.manifest, access=False)
            binding = bind_at(template, client, placements, message.max_tokens, message.kv_quota_bytes)
            # The weights' pages in this process's page tables now, while it waits at idle
            # priority: the activation's first forward pass would fault them in (6-10 ms).
            client.populate(template.manifest, placements)
            # It pins no weights while it waits: the pool may evict or move the model. It keeps
            # its first KV blocks (a few MiB; the session's own, like a running instance's),
            # where the pool can keep them over the release (an older daemon frees them).
            if handler is None and client.keeps_kv:
                _hold_first_kv(binding, client)
            client.release(keep_kv=client.keeps_kv)
            # Watched from now on: its pool's death ends it (its session, the arena it maps
            # and its KV blocks are gone), and the activation starts no thread (~0.1-0.5 ms
            # on a busy 2-core host, on the cold path).
            client.watch(state.pool_lost)
            return binding, client, placements
        except BaseException:
            client.close()
            raise

    binding, client, placements = await asyncio.to_thread(attach)
    standby = Standby(message, binding, client, placements, handler)
    timings = {**binding.timings_ms, "prepare_ms": (time.perf_counter() - t0) * 1e3}
    return standby, StandbyReply(timings)


def _prefix_prefetch(source: PoolBlockSource) -> PrefixPrefetch | None:
    """What prefix KV to ask the pool for with an engine's first blocks (None: it shares none)."""
    from gpu_pool.client import PrefixPrefetch

    if source.prefix_model is None:
        return None
    return PrefixPrefetch(
        source.prefix_model, source.layout, max(1, PREFIX_PREFETCH_BYTES // source.block_bytes)
    )


def _hold_first_kv(binding: ModelBinding, client: Any) -> None:
    """A standby's engine takes its first KV blocks now, the first ones filled with the prefix
    its function's last new instance restored from a first block: the activation then needs
    neither a block allocation nor a prefix copy, and the first request no restore round trip.
    Without room (or quota) for them the activation asks again."""
    from gpu_pool.client import RemotePoolError
    from gpu_pool.errors import KVQuotaExceeded, OutOfMemory

    engine = binding.engine
    source = engine.blocks.source
    num_blocks = engine.kv_prefetch()
    if num_blocks == 0 or not isinstance(source, PoolBlockSource):
        return
    try:
        kv = client.kv_alloc(num_blocks, source.block_bytes, aligned=True, prefix=_prefix_prefetch(source))
    except RemotePoolError as exc:
        if exc.kind in (OutOfMemory, KVQuotaExceeded):
            return
        raise
    engine.adopt_kv(source.adopt(kv), kv.prefix_hashes)
    refused = client.populate_kv(kv)
    if refused is not None:
        log.info("KV pages not populated ahead (%s): the first prefill faults them in", refused)


async def _acquire(
    binding: ModelBinding, client: Any, prefetch_kv: bool, standby_placements: dict[str, int]
) -> tuple[dict[str, int], Any]:
    """Pin the standby's model (at ``standby_placements`` when nothing moved it meanwhile:
    then the session's ``reacquire`` pins what the standby's release unpinned, in one short
    message); with ``prefetch_kv``, the engine's first KV blocks (what
    :meth:`Engine.scale_kv` would fetch after the activation, another round trip before the
    first request's prefill) come in the same round trip, and with them, when the engine
    shares prefixes, up to :data:`PREFIX_PREFETCH_BYTES` of the prefix the function's last new
    instance restored first (its first request would restore it: another round trip). Returns
    the placements and the blocks (a ``KVBlocks``, or None: none asked for, or no room). A
    standby holds its first blocks already (:func:`_hold_first_kv`): then it asks for none."""
    source = binding.engine.blocks.source
    num_blocks = binding.engine.kv_prefetch() if prefetch_kv else 0
    if num_blocks == 0 or not isinstance(source, PoolBlockSource):
        if client.can_reacquire:  # what the standby released, without the manifest (~1 ms less)
            placements = await client.reacquire_async(binding.template.manifest)
            return (standby_placements if placements is None else placements), None
        return await client.acquire_async(binding.template.manifest)  # type: ignore[no-any-return]
    return await client.acquire_async(  # type: ignore[no-any-return]
        binding.template.manifest, num_blocks, source.block_bytes, _prefix_prefetch(source)
    )


async def activate(
    standby: Standby, message: AssignMessage, on_pool_lost: Callable[[], None] = pool_lost
) -> tuple[Assignment, AssignReply]:
    """Turn ``standby`` into instance ``message.instance_id`` (:class:`StandbyMismatch` when
    ``message`` assigns something else). A failed acquire or initializer closes the standby.
    ``on_pool_lost``: called when the pool dies, unless the standby's session is watched
    already (:func:`prepare` watches it)."""
    if not standby.message.activated_by(message):
        raise StandbyMismatch(f"this worker is a standby of {standby.name!r} for another assignment")
    t0 = time.perf_counter()
    set_idle_priority(False)
    _threads(message.num_threads)
    binding, client = standby.binding, standby.client
    try:
        # Awaited on the loop, not in a thread (a thread's wake-up and the GIL cost more than
        # the round trip): meanwhile the loop reads the requests sent ahead of the activation
        # (runtime.early_requests), which then wait for it.
        placements, kv = await _acquire(binding, client, standby.handler is None, standby.placements)
        timings = {"acquire_ms": (time.perf_counter() - t0) * 1e3}
        if placements != standby.placements:  # evicted or moved meanwhile: views on the new places
            binding.engine.close()  # (its KV blocks go with it)
            template, max_tokens = binding.template, binding.max_tokens_default
            binding = bind_at(template, client, placements, max_tokens, message.kv_quota_bytes, timings)
            if kv is None and standby.handler is None:
                _hold_first_kv(binding, client)  # the new engine's first blocks, with the prefix
        else:
            binding.acquire_report = client.last_acquire
        if kv is not None:
            source = binding.engine.blocks.source
            assert isinstance(source, PoolBlockSource)
            binding.engine.adopt_kv(source.adopt(kv), kv.prefix_hashes)
        # LoRA adapters are dynamic (session-private): the standby held none, the instance
        # acquires its own now, beside the shared base.
        binding.attach_adapters(client, load_adapters(tuple(message.adapters.items())))
    except BaseException:
        standby.close()
        raise
    assignment = await _serve(message, binding, client, standby.handler, on_pool_lost)
    timings["assign_ms"] = timings["activate_ms"] = (time.perf_counter() - t0) * 1e3
    binding.timings_ms = timings
    return assignment, AssignReply(message.instance_id, timings, binding.acquire_report)
