"""Standbys (issue 10, cold path): an instance that idled out leaves a worker prepared for its
function; the next start activates it, skipping sandbox, pool session, views and engine build.
A standby pins nothing (its model can be evicted), so an activation re-acquires and rebuilds on
the new placements when the pool moved the weights. Real processes: a pool daemon and
``python -m runtime`` workers serving the tiny model."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_pool.arena.mapping import PAGE_BYTES
from gpu_pool.client import PoolClient
from runtime.agent import LaunchError, NodeAgent
from runtime.assignment import Standby, StandbyMismatch, _hold_first_kv, activate, prepare
from runtime.core_spread import SPREAD_S
from runtime.engine.sampling import SamplingParams
from runtime.instance import bind, bind_at, load_template
from runtime.messages import AssignMessage, MessageError, StandbyMessage, StandbyReply
from runtime.registry import RegisteredModel
from runtime.standby_pool import ANNOUNCE_S
from runtime.worker_guard import TOKEN_HEADER
from runtime.worker_state import WorkerState
from tests.conftest import CountingSocket, PoolProcess, mapped_pages
from tests.runtime.test_agent_workers import agent_config, policies, spec, wait_warm
from tests.runtime.tiny_gguf import hf_weights, register_tiny, write_tiny_gguf

PROMPT = {"prompt": "abc", "max_tokens": 6, "temperature": 0}


def test_standby_message_is_checked_and_matches_only_its_own_assignment() -> None:
    document = spec("f", {"source": "/m/tiny.gguf"})
    message = StandbyMessage(document, "/models/m", "/run/pool.sock", "ticket-1", 4096)
    assert StandbyMessage.from_json(message.to_json()) == message
    deadline = time.time() + 60
    assign = AssignMessage("7", document, "/models/m", "/run/pool.sock", "ticket-1", deadline, 2, 4096)
    assert message.activated_by(assign)
    other_spec = copy.deepcopy(document)
    other_spec["spec"]["maxTokens"] += 1
    for changed in (
        AssignMessage("7", other_spec, "/models/m", "/run/pool.sock", "ticket-1", time.time() + 60, 2, 4096),
        AssignMessage("7", document, "/models/n", "/run/pool.sock", "ticket-1", time.time() + 60, 2, 4096),
        AssignMessage("7", document, "/models/m", "/run/pool.sock", "ticket-2", time.time() + 60, 2, 4096),
        AssignMessage("7", document, "/models/m", "/run/pool.sock", "ticket-1", time.time() + 60, 2, 8192),
    ):
        assert not message.activated_by(changed)
    with pytest.raises(MessageError, match="missing"):
        StandbyMessage.from_json('{"spec": {}}')
    with pytest.raises(MessageError, match="kv_quota_bytes"):
        StandbyMessage(document, "/models/m", "/run/pool.sock", "t", -1)
    with pytest.raises(MessageError, match="spec"):
        StandbyMessage({"spec": {}}, "/models/m", "/run/pool.sock", "t", 1)
    reply = StandbyReply({"prepare_ms": 1.5})
    assert StandbyReply.from_json(reply.to_json()) == reply
    with pytest.raises(MessageError, match="timings_ms"):
        StandbyReply({"prepare_ms": -1.0})
    assert issubclass(StandbyMismatch, Exception) and StandbyMismatch.code == "standby_mismatch"


def custom_function(tmp_path: Path, name: str, code: str) -> tuple[Path, dict[str, Any], str]:
    """EMBER_HOME, a spec of function ``name`` whose handler module holds ``code``, and the
    tiny model's source."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    home = tmp_path / "home"
    module = home / "functions" / "default" / name / "v1" / f"{name}.py"
    module.parent.mkdir(parents=True)
    module.write_text(code)
    document = spec(name, {"source": str(tmp_path / "tiny.gguf")})
    document["spec"]["handler"] = f"{module}:handler"
    return home, document, str(tmp_path / "tiny.gguf")


@asynccontextmanager
async def started_agent(
    home: Path, source: str, **overrides: Any
) -> AsyncIterator[tuple[NodeAgent, dict[str, Any], str]]:
    """A started agent (one pre-warmed worker, one standby unless ``overrides`` say otherwise)
    with the model ``source`` registered: the agent, the model's document and the device id."""
    agent = NodeAgent(agent_config(home, **{"prewarm": 1, "standby": 1, **overrides}))
    try:
        await agent.start()
        model = await agent.ensure_model(source, "float32")
        yield agent, model, agent.devices()[0]
    finally:
        await agent.close()


async def wait_standby(agent: NodeAgent, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        (record,) = (await agent.report()).values()
        if record["standby_workers"] == n:
            return
        assert time.monotonic() < deadline, f"no {n} standby workers: {record}"
        await asyncio.sleep(0.1)


async def leave_standby(
    agent: NodeAgent, document: dict[str, Any], model: dict[str, Any], device: str
) -> None:
    """Start instance "1" of ``document`` on a pre-warmed worker and idle it out: it leaves a
    standby (a pre-warmed worker is ready again too)."""
    await wait_warm(agent, 1)
    await agent.launch("1", document, model, device, time.time() + 120)
    await wait_warm(agent, 1)
    await agent.stop("1", standby=True)
    await wait_standby(agent, 1)


async def complete(url: str, token: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        resp = await http.post("/v1/completions", json=PROMPT, headers={TOKEN_HEADER: token})
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["text"])


@pytest.mark.slow
def test_an_idled_out_instance_leaves_a_standby_that_the_next_start_activates(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    write_tiny_gguf(tmp_path / "other.gguf", hf_weights(4))

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", str(tmp_path / "tiny.gguf")) as (agent, model, device):
            document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
            await wait_warm(agent, 1)
            first = await agent.launch("1", document, model, device, time.time() + 120)
            expected = await complete(first.url, first.token)
            assert "activate_ms" not in first.timings_ms

            # Retired (delete, redeploy, lost): no standby.
            await agent.stop("1")
            await asyncio.sleep(0.5)
            assert (await agent.report())[device]["standby_workers"] == 0

            # Idled out: a standby is prepared from a pre-warmed worker, which is replaced.
            second = await agent.launch("2", document, model, device, time.time() + 120)
            await wait_warm(agent, 1)  # a standby takes a worker ready now (it never waits for one)
            reused = (await agent.report())[device]["bytes_reused"]
            await agent.stop("2", standby=True)
            await wait_standby(agent, 1)
            # Its preparation is not a request for the model: no reuse (nor request rate) counted.
            assert (await agent.report())[device]["bytes_reused"] == reused
            await wait_warm(agent, 1)
            (standby_pid,) = agent._standbys.pids()
            # Prepared at idle priority, and out of it once ready: its activation skips the move.
            assert policies(standby_pid) == {os.SCHED_OTHER}
            pool_pid = agent.pools["cpu"].proc.pid
            cores = os.sched_getaffinity(0)
            spread: list[set[int]] = []  # (the standby's, the pool's masks as the assign goes out)

            def on_target(url: str, token: str) -> None:
                spread.extend((os.sched_getaffinity(standby_pid), os.sched_getaffinity(pool_pid)))

            third = await agent.launch("3", document, model, device, time.time() + 120, on_target)
            assert third.pid == standby_pid and "activate_ms" in third.timings_ms
            # Spread over the cores while it activated (runtime.core_spread), every thread put
            # back after.
            if len(cores) > 1:
                assert len(spread[1]) == 1 and spread[0] == cores - spread[1]
            await asyncio.sleep(SPREAD_S)
            for pid in (standby_pid, pool_pid):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    assert os.sched_getaffinity(int(tid)) == cores, (pid, tid)
            assert third.bytes_loaded == 0 and third.bytes_reused == first.bytes_loaded > 0
            assert (await agent.report())[device]["standby_workers"] == 0
            assert await complete(third.url, third.token) == expected

            # A standby pins nothing: its model is evicted, another model takes the space, and
            # the activation loads the weights again and rebuilds its views where they are now.
            await wait_warm(agent, 1)
            await agent.stop("3", standby=True)
            await wait_standby(agent, 1)
            assert await agent.evict(model["id"]) > 0
            other = await agent.ensure_model(str(tmp_path / "other.gguf"), "float32")
            other_doc = spec("other", {"source": str(tmp_path / "other.gguf")})
            occupant = await agent.launch("4", other_doc, other, device, time.time() + 120)
            fourth = await agent.launch("5", document, model, device, time.time() + 120)
            assert "activate_ms" in fourth.timings_ms and fourth.bytes_loaded > 0
            assert "build_ms" in fourth.timings_ms  # new placements (the other model took the old)
            assert await complete(fourth.url, fourth.token) == expected
            await complete(occupant.url, occupant.token)  # the other model serves beside it

            # A redeploy (another spec) ends the standby: the start takes a pre-warmed worker.
            await wait_warm(agent, 1)
            await agent.stop("5", standby=True)
            await wait_standby(agent, 1)
            (old_pid,) = agent._standbys.pids()
            redeployed = copy.deepcopy(document)
            redeployed["spec"]["maxTokens"] = document["spec"]["maxTokens"] - 1
            await wait_warm(agent, 1)
            fifth = await agent.launch("6", redeployed, model, device, time.time() + 120)
            assert fifth.pid != old_pid and "activate_ms" not in fifth.timings_ms
            assert await complete(fifth.url, fifth.token) == expected
            assert (await agent.report())[device]["standby_workers"] == 0
            assert second.pid != third.pid

    asyncio.run(scenario())


async def wait_kv_bytes(agent: NodeAgent, device: str, more_than: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (held := (await agent.report())[device]["kv_bytes"]) <= more_than:
        assert time.monotonic() < deadline, f"the pool holds {held} KV bytes, not more than {more_than}"
        await asyncio.sleep(0.05)
    return int(held)


@pytest.mark.slow
def test_a_started_instance_fetches_its_first_kv_blocks_before_its_first_request(tmp_path: Path) -> None:
    """Off the first request's path (a pool round trip), from a pre-warmed worker and from a standby."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", str(tmp_path / "tiny.gguf")) as (agent, model, device):
            document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
            await wait_warm(agent, 1)
            assert (await agent.report())[device]["kv_bytes"] == 0
            first = await agent.launch("1", document, model, device, time.time() + 120)
            assert await wait_kv_bytes(agent, device, 0) > 0
            expected = await complete(first.url, first.token)
            await agent.stop("1", standby=True)
            await wait_standby(agent, 1)
            await wait_warm(agent, 1)
            # A standby takes its first blocks while it waits (runtime.assignment): they are
            # there before the activation, and the instance keeps them.
            assert (await agent.report())[device]["kv_bytes"] > 0
            second = await agent.launch("2", document, model, device, time.time() + 120)
            assert "activate_ms" in second.timings_ms
            await wait_kv_bytes(agent, device, 0)
            assert await complete(second.url, second.token) == expected

    asyncio.run(scenario())


def standby_by_hand(
    tiny: RegisteredModel, pool: PoolProcess, document: dict[str, Any], hold_kv: bool
) -> Standby:
    """A standby of ``tiny`` as :func:`prepare` leaves one (in this process): its model resident
    and released; with ``hold_kv``, holding its engine's first KV blocks."""
    template = load_template(tiny.directory)
    client = PoolClient(pool.socket_path)
    placements = client.acquire_placements(template.manifest)  # resident now
    binding = bind_at(template, client, placements, 64)
    if hold_kv:
        _hold_first_kv(binding, client)
    client.release(keep_kv=hold_kv)  # a standby pins no weights
    prepared = StandbyMessage(document, str(tiny.directory), pool.socket_path, None, 1 << 20)
    return Standby(prepared, binding, client, placements, None)


def first_assign(tiny: RegisteredModel, pool: PoolProcess, document: dict[str, Any]) -> AssignMessage:
    """The assign that makes a standby of ``tiny`` instance 1."""
    return AssignMessage(
        "1", document, str(tiny.directory), pool.socket_path, None, time.time() + 60, None, 1 << 20
    )


def test_an_activation_brings_its_first_kv_blocks_with_its_weights(tmp_path: Path) -> None:
    """A standby's activation asks for its engine's first KV blocks in the same pool round trip
    as its weights (PoolClient.acquire_with_kv): its engine holds them when the activation
    returns, before the first request, which would otherwise wait behind another round trip.
    In process, on a real pool daemon: no background fetch can race the check."""
    tiny = register_tiny(tmp_path)
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})

    async def scenario() -> None:
        standby = standby_by_hand(tiny, pool, document, hold_kv=False)
        client = standby.client
        assert standby.binding.engine.kv_prefetch() > 0 and not standby.binding.engine.blocks.free
        counted = CountingSocket(client._sock)
        client._sock = counted
        assignment, reply = await activate(standby, first_assign(tiny, pool, document))
        try:
            assert counted.writes == 1  # weights and blocks: one round trip
            engine = assignment.binding.engine
            assert len(engine.blocks.free) > 0 and engine.kv_prefetch() == 0  # nothing left to fetch
            block_bytes = engine.blocks.source.block_bytes
            with PoolClient(pool.socket_path) as observer:
                assert observer.stats()["kv_bytes"] == len(engine.blocks.free) * block_bytes
            assert reply.acquire.bytes_loaded == 0
        finally:
            assignment.driver.cancel()
            engine.close()
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        pool.stop()


def test_an_activation_pins_its_unmoved_weights_without_sending_the_manifest(tmp_path: Path) -> None:
    """A standby holding its first KV blocks activates with the session's ``reacquire``: one
    short message instead of the manifest, and its views stay (the weights did not move)."""
    tiny = register_tiny(tmp_path)
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})

    async def scenario() -> None:
        standby = standby_by_hand(tiny, pool, document, hold_kv=True)
        binding, client, template = standby.binding, standby.client, standby.binding.template
        counted = CountingSocket(client._sock)
        client._sock = counted
        assignment, reply = await activate(standby, first_assign(tiny, pool, document))
        try:
            assert counted.writes == 1 and counted.bytes < 100 < len(template.manifest.encoded())
            assert assignment.binding is binding and "build_ms" not in reply.timings_ms
            assert reply.acquire.bytes_loaded == 0 and reply.acquire.bytes_reused == template.manifest.nbytes
            with PoolClient(pool.socket_path) as observer:
                assert observer.stats()["pinned_bytes"] > 0
        finally:
            assignment.driver.cancel()
            binding.engine.close()
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        pool.stop()


def test_a_standby_holds_its_first_kv_blocks_in_its_page_tables(tmp_path: Path) -> None:
    """The first KV blocks a standby holds are in its page tables before it is activated
    (PoolClient.populate_kv): its first prefill writes them without a page fault per page
    (~80 faults of ~3 us each for SmolLM2, on a cold start's path). Blocks fetched later
    are not, until written."""
    tiny = register_tiny(tmp_path)
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
    standby = standby_by_hand(tiny, pool, document, hold_kv=True)
    client, engine = standby.client, standby.binding.engine
    try:
        source = engine.blocks.source
        held = list(engine.blocks.free)
        later = client.kv_alloc(len(held), source.block_bytes, aligned=True)
        base = client.kv_arena().data_ptr()
        pages = -(-source.block_bytes // PAGE_BYTES)
        assert held and source.block_bytes % PAGE_BYTES == 0  # (whole pages: none shared)

        def mapped(offsets: list[int]) -> list[bool]:
            return [m for offset in offsets for m in mapped_pages(base + offset, pages)]

        assert all(mapped([b * source.block_bytes for b in held]))
        assert not any(mapped(list(later.offsets)))
        client.kv_arena()[later.offsets[0]] = 1  # written: mapped (the check sees page tables)
        assert mapped(list(later.offsets[:1]))[0]
    finally:
        engine.close()
        client.close()
        pool.stop()


ECHO = """async def handler(event, context):
    return event
"""


def generate(engine: Any, prompt: list[int]) -> tuple[list[int], int]:
    """A greedy request run to its end by stepping ``engine`` here: its tokens and cached tokens."""
    seq_id = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq_id == seq_id and out.token_id is not None:
                tokens.append(out.token_id)
                cached = max(cached, out.cached_tokens)
    return tokens, cached


@pytest.mark.slow
@pytest.mark.parametrize("prepared_by", ["prepare", "hand", "moved"])
def test_a_start_brings_the_prefix_its_functions_last_start_restored(
    tmp_path: Path, prepared_by: str
) -> None:
    """The function's last new instance restored its first request's prompt from its first
    block; the pool remembers that prefix and fills a new engine's first KV blocks with its
    published blocks: a standby's preparation takes them (``prepare``), or, when the standby
    holds no blocks (made by hand here, as when the pool had no room for them then), the
    activation's acquire brings them with the weights. Either way the activation is one round
    trip and the next first request with that prompt finds the prefix in its own engine,
    without a ``kv_restore`` round trip, reports it as cached and computes the same tokens.
    When the weights moved while the standby waited (``moved``: the activation rebuilds the
    engine on the new placements), the new engine takes its first blocks with the prefix
    again (two more round trips: the old engine's blocks freed, the new ones taken)."""
    tiny = register_tiny(tmp_path)
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16
    watched: list[PoolClient] = []  # closed before the pool stops (its watch would end pytest)

    async def scenario() -> None:
        template = load_template(tiny.directory)
        with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:
            tickets = [admin.grant(1 << 20, prefix_scope="tiny") for _ in range(2)]
        first = PoolClient(pool.socket_path, ticket=tickets[0])  # the function's last instance
        binding = bind(template, first, 64, progressive=False)
        expected, cached = generate(binding.engine, prompt)
        assert cached == 0
        binding.engine.blocks.flush_publish()  # (the engine does it between requests)
        binding.engine.close()
        first.close()

        prepared = StandbyMessage(document, str(tiny.directory), pool.socket_path, tickets[1], 1 << 20)
        if prepared_by in ("prepare", "moved"):
            standby, _ = await prepare(WorkerState(), prepared)
            assert len(standby.binding.engine.blocks.cached) == 2  # before the activation
            assert standby.client.watched  # its pool's death ends it; the activation starts no thread
            if prepared_by == "moved":  # as if moved meanwhile (a move keeps the prefix KV;
                # an eviction would drop it): the views point elsewhere than the pool's places,
                # which a full acquire (an older daemon's: no reacquire) tells the activation.
                standby.placements = {name: offset + 1 for name, offset in standby.placements.items()}
                standby.client.features -= {"reacquire"}
        else:
            client = PoolClient(pool.socket_path, ticket=tickets[1])
            placements = client.acquire_placements(template.manifest, access=False)
            binding = bind_at(template, client, placements, 64)
            client.release()
            standby = Standby(prepared, binding, client, placements, None)
        client = standby.client
        watched.append(client)
        counted = CountingSocket(client._sock)
        client._sock = counted
        message = AssignMessage(
            "2", document, str(tiny.directory), pool.socket_path, tickets[1], time.time() + 60, None, 1 << 20
        )
        assignment, _ = await activate(standby, message)
        engine = assignment.binding.engine
        activation_writes = 3 if prepared_by == "moved" else 1
        try:
            assert client.watched
            assert (assignment.binding is not standby.binding) == (prepared_by == "moved")
            assert counted.writes == activation_writes and len(engine.blocks.cached) == 2
            tokens, cached = generate(engine, prompt)
            assert counted.writes == activation_writes, "the first request asked the pool for its prefix"
            assert cached == 32 and engine.blocks.stats.restored_tokens == 32
            assert tokens == expected
        finally:
            assignment.driver.cancel()
            engine.close()
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        for client in watched:
            client.close()
        pool.stop()


@pytest.mark.slow
def test_a_custom_handler_fetches_no_kv_blocks_it_may_never_use(tmp_path: Path) -> None:
    home, document, source = custom_function(tmp_path, "echo", ECHO)

    async def scenario() -> None:
        async with started_agent(home, source, standby=0) as (agent, model, device):
            await wait_warm(agent, 1)
            started = await agent.launch("1", document, model, device, time.time() + 120)
            async with httpx.AsyncClient(base_url=started.url, timeout=60) as http:
                resp = await http.post("/invoke", json={"x": 1}, headers={TOKEN_HEADER: started.token})
                assert resp.status_code == 200 and resp.json() == {"x": 1}, resp.text
            assert (await agent.report())[device]["kv_bytes"] == 0

    asyncio.run(scenario())


@pytest.mark.slow
def test_standbys_are_bounded_and_expire(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))

    async def scenario() -> None:
        tiny = str(tmp_path / "tiny.gguf")
        async with started_agent(tmp_path / "home", tiny, standby_ttl_s=60.0) as (agent, model, device):
            docs = [spec(name, {"source": str(tmp_path / "tiny.gguf")}) for name in ("a", "b")]
            for i, document in enumerate(docs):
                await wait_warm(agent, 1)
                await agent.launch(str(i), document, model, device, time.time() + 120)
                await wait_warm(agent, 1)
                await agent.stop(str(i), standby=True)
                deadline = time.monotonic() + 120
                while document["metadata"]["name"] not in agent._standbys._ready:
                    assert time.monotonic() < deadline, "the standby was never prepared"
                    await asyncio.sleep(0.1)
            # At most one: "b"'s standby ended "a"'s.
            assert list(agent._standbys._ready) == ["b"]
            await agent._standbys.expire(time.monotonic() + 59.0)  # not yet
            assert list(agent._standbys._ready) == ["b"]
            await agent._standbys.expire(time.monotonic() + 61.0)  # past standby_ttl_s
            await wait_standby(agent, 0)

    asyncio.run(scenario())


def test_standby_config_is_validated(tmp_path: Path) -> None:
    for bad in ({"standby": -1}, {"standby": 65}, {"standby_ttl_s": 0.0}):
        with pytest.raises(ValueError, match="standby"):
            agent_config(tmp_path, prewarm=1, **bad)


@pytest.mark.slow
def test_a_standby_loads_nothing(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", str(tmp_path / "tiny.gguf")) as (agent, model, device):
            document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
            await agent.launch("1", document, model, device, time.time() + 120)
            assigned = agent._instances["1"].assigned
            assert assigned is not None
            await agent.stop("1")
            assert await agent.evict(model["id"]) > 0  # the pool gave its space to others
            await wait_warm(agent, 1)
            (before,) = (await agent.report()).values()
            await agent._standbys.prepare(assigned, "cpu")  # what stop(standby=True) runs
            (after,) = (await agent.report()).values()
            assert after["standby_workers"] == 0 and after["bytes_loaded"] == before["bytes_loaded"]
            assert model["id"] not in after["models"] or after["models"][model["id"]] == 0

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_standby_leaves_the_pre_warmed_workers_to_launches(tmp_path: Path) -> None:
    """A standby is a worker of its own: taking a ready pre-warmed worker for it made the next
    cold start of any other function wait for a process start (prewarm 2 and two functions
    idling out together left none)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", str(tmp_path / "tiny.gguf")) as (agent, model, device):
            document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
            await agent.launch("1", document, model, device, time.time() + 120)
            (ready,) = await wait_warm(agent, 1)
            await agent.stop("1", standby=True)
            await asyncio.sleep(0.2)  # the preparation is under way
            assert agent.warm() == [ready]
            await wait_standby(agent, 1)
            assert agent.warm() == [ready]  # the next launch of another function takes it at once
            assert ready[0] not in agent._standbys.pids()

    asyncio.run(scenario())


SLOW_IMPORT = """import sys, time
print("standby-marker: importing", file=sys.stderr, flush=True)
time.sleep(4)


async def handler(event, context):
    return event
"""


@pytest.mark.slow
def test_a_standby_whose_pool_died_while_it_was_prepared_is_not_kept(tmp_path: Path) -> None:
    """The pool dies while a standby is being prepared (after its session attached): the
    standby's session is gone with it, so it is not kept (it held the dead arena's memory and
    its activation could only fail)."""
    home, document, source = custom_function(tmp_path, "slow", SLOW_IMPORT)

    async def scenario() -> None:
        async with started_agent(home, source) as (agent, model, device):
            await agent.launch("1", document, model, device, time.time() + 120)
            await agent.stop("1", standby=True)
            deadline = time.monotonic() + 120
            workers = agent.config.log_dir / "workers"
            while not any("standby-marker" in p.read_text(errors="replace") for p in workers.iterdir()):
                assert time.monotonic() < deadline, "the standby never imported its handler"
                await asyncio.sleep(0.05)
            os.kill(agent.pools["cpu"].proc.pid, signal.SIGKILL)  # its session attached: it dies now
            while agent._standbys._preparing or not agent.pool_alive("cpu"):
                assert time.monotonic() < deadline, "the preparation or the pool restart never ended"
                await asyncio.sleep(0.1)
            assert agent._standbys.pids() == []

    asyncio.run(scenario())


FLAKY = """
import os
from pathlib import Path

from runtime.sdk import init


@init(static=True)
def setup(context):
    # Counts its runs in the worker's TMPDIR (EMBER_HOME/tmp, shared by the node's workers):
    # the first succeeds, every later one fails.
    runs = Path(os.environ["TMPDIR"]) / "flaky-runs"
    n = len(runs.read_text()) if runs.exists() else 0
    runs.write_text("x" * (n + 1))
    if n:
        raise RuntimeError("the initializer fails from its second run on")
    return {}


async def handler(event, context):
    return event
"""


@pytest.mark.slow
def test_a_failing_initializer_is_not_run_again_elsewhere_and_retire_ends_the_standby(tmp_path: Path) -> None:
    home, document, source = custom_function(tmp_path, "flaky", FLAKY)

    async def scenario() -> None:
        async with started_agent(home, source) as (agent, model, device):
            await leave_standby(agent, document, model, device)
            # The activation's initializer fails: a function error, not the worker's. It is
            # not run a third time on a pre-warmed worker.
            with pytest.raises(LaunchError, match="initializer fails"):
                await agent.launch("2", document, model, device, time.time() + 120)
            assert (home / "tmp" / "flaky-runs").read_text() == "xx"

            # A retired function (deleted, redeployed) keeps no standby.
            plain = spec("plain", {"source": source})
            await wait_warm(agent, 1)
            await agent.launch("3", plain, model, device, time.time() + 120)
            await wait_warm(agent, 1)
            await agent.stop("3", standby=True)
            await wait_standby(agent, 1)
            (pid,) = agent._standbys.pids()
            await agent.retire("plain")
            assert (await agent.report())[device]["standby_workers"] == 0
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_ready_standby_is_announced_and_again_while_it_waits(tmp_path: Path) -> None:
    """``on_standby`` hears each standby once it is ready (the gateway opens a connection to
    it for the request it may send ahead of the activation) and every ``ANNOUNCE_S`` while
    it waits (that connection would otherwise idle out)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    source = str(tmp_path / "tiny.gguf")

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", source) as (agent, model, device):
            announced: list[tuple[str, str]] = []
            agent.on_standby(lambda url, token: announced.append((url, token)))
            await leave_standby(agent, spec("tiny", {"source": source}), model, device)
            (standby,) = agent._standbys._ready.values()
            assert announced == [(standby.worker.url, standby.worker.token)]
            await agent._standbys.expire(standby.since + ANNOUNCE_S / 2)
            assert len(announced) == 1
            await agent._standbys.expire(standby.since + ANNOUNCE_S)
            assert announced == [(standby.worker.url, standby.worker.token)] * 2

    asyncio.run(scenario())
