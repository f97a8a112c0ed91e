"""Instance workers that outlive their pool daemon (:mod:`runtime.survivors`): the bookkeeping
with real processes standing in for nothing but themselves, then the whole path with a real
agent, pool daemon and ``python -m runtime`` workers serving the tiny model."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_pool.client import PoolClient
from runtime.agent import NodeAgent
from runtime.assignment import prepare
from runtime.early_requests import INSTANCE_HEADER, NEVER_RAN_HEADER, NOT_STARTED
from runtime.errors import LaunchError
from runtime.instance import load_template
from runtime.messages import AssignMessage, StandbyMessage
from runtime.survivors import Survivors
from runtime.worker_guard import TOKEN_HEADER
from runtime.worker_handle import WorkerHandle
from runtime.worker_state import WorkerState
from tests.conftest import PoolProcess
from tests.runtime.test_agent_workers import agent_config, spec, wait_warm
from tests.runtime.test_standby import PROMPT, complete, custom_function, started_agent
from tests.runtime.tiny_gguf import hf_weights, register_tiny, write_tiny_gguf


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def survivor(tmp_path: Path, document: dict[str, Any], device: str = "cpu") -> WorkerHandle:
    """A process (``sleep``) as a survivor's worker of ``document`` on ``device``."""
    proc = await asyncio.create_subprocess_exec("sleep", "120")
    worker = WorkerHandle(proc, "http://127.0.0.1:1", tmp_path / f"{proc.pid}.log", "t", device=device)
    worker.assigned = AssignMessage("1", document, "/models/m", "/run/pool.sock", None, time.time() + 60)
    return worker


def test_a_survivor_is_taken_only_for_its_own_spec_and_ends_when_not_needed(tmp_path: Path) -> None:
    document = spec("f", {"source": "/x.gguf"})
    redeployed = copy.deepcopy(document)
    redeployed["spec"]["scaling"]["keepAlive"] = "20s"

    async def scenario() -> None:
        survivors = Survivors(agent_config(tmp_path, 0, survivor_keep_s=5.0))
        assert survivors.enabled
        first, second, other = [await survivor(tmp_path, document) for _ in range(3)]
        for worker in (first, second):
            survivors.add(worker, "cpu")
        other_doc = spec("g", {"source": "/x.gguf"})
        other.assigned = AssignMessage("2", other_doc, "/models/m", "/run/pool.sock", None, time.time() + 60)
        survivors.add(other, "cpu")
        assert sorted(survivors.pids()) == sorted(w.pid for w in (first, second, other))

        # Another device, another model: none; the same spec and model: one, at most once.
        assert await survivors.take(document, "/models/m", "cuda:0") is None
        assert await survivors.take(document, "/models/other", "cpu") is None  # ended: redeployed
        await until(lambda: not first.running and not second.running)

        first, second = await survivor(tmp_path, document), await survivor(tmp_path, document)
        for worker in (first, second):
            survivors.add(worker, "cpu")
        assert await survivors.take(document, "/models/m", "cpu") is first
        assert await survivors.take(document, "/models/m", "cpu") is second
        assert await survivors.take(document, "/models/m", "cpu") is None
        assert first.running and second.running  # taken: the caller assigns them

        # A redeployed function's survivors end; so do those kept past survivor_keep_s, and a
        # retired function's.
        survivors.add(first, "cpu")
        assert await survivors.take(redeployed, "/models/m", "cpu") is None
        await until(lambda: not first.running)
        survivors.add(second, "cpu")
        await survivors.expire(time.monotonic() + 1.0)
        assert second.running and other.running
        await survivors.expire(time.monotonic() + 6.0)
        await until(lambda: not second.running and not other.running)
        assert survivors.pids() == []
        third = await survivor(tmp_path, document)
        survivors.add(third, "cpu")
        await survivors.end("f")
        assert not third.running and survivors.pids() == []

    asyncio.run(scenario())
    with pytest.raises(ValueError):
        agent_config(tmp_path, 0, survivor_keep_s=-1.0)


async def ask(url: str, token: str, instance_id: str | None) -> httpx.Response:
    headers = {TOKEN_HEADER: token} | ({INSTANCE_HEADER: instance_id} if instance_id else {})
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post("/v1/completions", json=PROMPT, headers=headers)


def kill_pool(agent: NodeAgent) -> int:
    pid = int(agent.pools["cpu"].proc.pid)
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_an_instance_whose_pool_died_starts_again_in_the_same_worker(tmp_path: Path) -> None:
    """The pool dies: the instance ends at once (the agent no longer runs it, a request for it
    is answered that it never ran) but its worker lives; the function's next start, on the
    restarted pool, assigns that worker again (weights loaded again, same answers). A
    redeployed function's survivor is not reused: it ends."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    source = str(tmp_path / "tiny.gguf")

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", source, standby=0) as (agent, model, device):
            document = spec("tiny", {"source": source})
            await wait_warm(agent, 1)
            first = await agent.launch("1", document, model, device, time.time() + 120)
            expected = await complete(first.url, first.token)
            await wait_warm(agent, 1)

            old_pool = kill_pool(agent)
            await until(lambda: not agent.alive("1"))
            assert agent.owns("1")  # until the router forgets it (stop)
            for named in ("1", None):  # named by the gateway, or not: never ran, route again
                resp = await ask(first.url, first.token, named)
                assert resp.status_code == 503 and resp.json()["error"]["type"] == NOT_STARTED, resp.text
                assert resp.headers[NEVER_RAN_HEADER] == "1" and resp.headers["retry-after"] == "1"
            await agent.stop("1")  # what the router does when it forgets it
            assert not agent.owns("1") and alive(first.pid)

            await until(lambda: agent.pool_alive("cpu") and agent.pools["cpu"].proc.pid != old_pool)
            second = await agent.launch("2", document, model, device, time.time() + 120)
            assert second.pid == first.pid and second.acquire.bytes_loaded > 0
            assert await complete(second.url, second.token) == expected
            log = Path(second.log_path)  # one file: instance 1's lines went with the worker
            assert not log.with_name("instance-1.log").exists()
            assert "instance 1 ends" in log.read_text()

            # Again, and the function is redeployed meanwhile: its survivor ends.
            kill_pool(agent)
            await until(lambda: not agent.alive("2"))
            await agent.stop("2")
            await until(lambda: agent.pool_alive("cpu"))
            redeployed = copy.deepcopy(document)
            redeployed["spec"]["scaling"]["keepAlive"] = "20s"
            await wait_warm(agent, 1)
            third = await agent.launch("3", redeployed, model, device, time.time() + 120)
            assert third.pid != first.pid
            await until(lambda: not alive(first.pid))
            assert await complete(third.url, third.token) == expected

    asyncio.run(scenario())


SLOW_INIT = """
import time

from runtime.sdk import init


@init(static=True)
def setup(context):
    time.sleep(3)  # the pool dies meanwhile
    return {}


def handler(event, context):
    return {"x": event["x"]}
"""


@pytest.mark.slow
def test_a_start_whose_pool_dies_meanwhile_fails_and_the_next_one_serves(tmp_path: Path) -> None:
    """The pool dies while an instance starts (its initializer runs): the start fails (it would
    be an instance on a dead pool, answering every request with an error), and the function's
    next start, on the restarted pool, serves."""
    home, document, source = custom_function(tmp_path, "slow", SLOW_INIT)

    async def scenario() -> None:
        async with started_agent(home, source, standby=0) as (agent, model, device):
            await wait_warm(agent, 1)
            launch = asyncio.create_task(agent.launch("1", document, model, device, time.time() + 120))
            await asyncio.sleep(1.5)  # in the initializer
            kill_pool(agent)
            with pytest.raises(LaunchError, match="pool"):
                await launch
            assert not agent.owns("1") and not agent.alive("1")
            await until(lambda: agent.pool_alive("cpu"))
            await wait_warm(agent, 1)
            second = await agent.launch("2", document, model, device, time.time() + 120)
            async with httpx.AsyncClient(base_url=second.url, timeout=60) as http:
                resp = await http.post("/invoke", json={"x": 7}, headers={TOKEN_HEADER: second.token})
            assert resp.status_code == 200 and resp.json() == {"x": 7}

    asyncio.run(scenario())


HOARDER = """
import builtins


def handler(event, context):
    builtins.kept_model = context.model  # outlives the instance: its engine maps the pool's memory
    return {"x": event["x"]}
"""


@pytest.mark.slow
def test_a_worker_that_still_maps_the_dead_pool_exits_instead_of_waiting(tmp_path: Path) -> None:
    """A handler kept a reference to its model beyond its instance: after the pool's death the
    worker would hold the dead arena's memory (and one more after every death), so it exits
    instead of waiting to be reused; the next start takes a pre-warmed worker."""
    home, document, source = custom_function(tmp_path, "hoarder", HOARDER)

    async def scenario() -> None:
        async with started_agent(home, source, standby=0) as (agent, model, device):
            await wait_warm(agent, 1)
            first = await agent.launch("1", document, model, device, time.time() + 120)
            async with httpx.AsyncClient(base_url=first.url, timeout=60) as http:
                resp = await http.post("/invoke", json={"x": 1}, headers={TOKEN_HEADER: first.token})
            assert resp.status_code == 200
            kill_pool(agent)
            await until(lambda: not alive(first.pid), timeout=30)
            await agent.stop("1")
            await until(lambda: agent.pool_alive("cpu"))
            await wait_warm(agent, 1)
            second = await agent.launch("2", document, model, device, time.time() + 120)
            assert second.pid != first.pid

    asyncio.run(scenario())


def test_a_worker_waits_only_when_its_pool_died_not_when_it_dropped_the_session(tmp_path: Path) -> None:
    """The pool's watch fires both when the daemon dies and when it drops one session. A pool
    that still accepts connections only dropped the session: the agent knows of no death, so
    the worker must exit as before (PoolClient.daemon_answers). A dead one: the worker ends
    its instance or standby and stays (here: the test process survives the watch)."""
    tiny = register_tiny(tmp_path)
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})

    async def scenario() -> None:
        with PoolClient(pool.socket_path) as loader:  # resident (a standby loads nothing)
            loader.acquire_placements(load_template(tiny.directory).manifest)
        state = WorkerState(survive_pool_loss=True, loop=asyncio.get_running_loop())
        message = StandbyMessage(document, str(tiny.directory), pool.socket_path, None, 1 << 20)
        state.standby, _ = await prepare(state, message)
        assert state.standby is not None
        assert state.standby.client.daemon_answers()  # alive: a dropped session means exit
        pool.stop()
        await until(lambda: state.standby is None, timeout=10)  # released by the watch, not exited

    try:
        asyncio.run(scenario())
    finally:
        pool.stop()
