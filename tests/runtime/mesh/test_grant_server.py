"""The agent's token scheduler and the workers' gates over real socketpairs."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from runtime.mesh.config import TokenSchedulingConfig
from runtime.mesh.gate import Gate
from runtime.mesh.grant_server import DeviceGrants
from runtime.mesh.wire import Message, Op, WireError, decode, encode


def pair(grants: DeviceGrants, instance_id: str) -> Gate:
    """A gate whose agent end ``grants`` schedules (the agent end closes with ``grants.close``
    here; in the agent the worker's handle owns it)."""
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    grants.attach(instance_id, agent_end)
    AGENT_ENDS.append(agent_end)
    return Gate(worker_end)


AGENT_ENDS: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_agent_ends() -> Iterator[None]:
    yield
    while AGENT_ENDS:
        AGENT_ENDS.pop().close()


async def _test_iterations_of_co_located_instances_never_overlap_and_go_by_deadline() -> None:
    grants = DeviceGrants("cpu")
    gates = {name: pair(grants, name) for name in ("a", "b", "c")}
    log: list[tuple[str, str]] = []
    running: set[str] = set()

    async def instance(name: str, deadlines: list[float]) -> None:
        gate = gates[name]
        for deadline in deadlines:
            await gate.acquire(deadline)
            assert not running, f"{name} runs while {running} run"
            running.add(name)
            log.append(("start", name))
            await asyncio.sleep(0.002)  # the iteration
            running.discard(name)
            gate.release()
        gate.idle()

    await asyncio.gather(
        instance("a", [5.0, 6.0, 7.0]), instance("b", [1.0, 2.0, 3.0]), instance("c", [4.0, 8.0, 9.0])
    )
    assert len(log) == 9
    assert grants.scheduler.running is None and not grants.scheduler.waiting
    for gate in gates.values():
        gate.close()
    grants.close()


async def _test_a_lone_instance_runs_on_a_lease_until_another_asks() -> None:
    grants = DeviceGrants("cpu")
    a, b = pair(grants, "a"), pair(grants, "b")
    for _ in range(5):
        await a.acquire(1.0)
        a.release()
    assert a.num_waits == 1  # one round trip, then the lease
    waiting_b = asyncio.create_task(b.acquire(0.5))
    await asyncio.sleep(0.01)
    assert not waiting_b.done()  # a holds the lease between its iterations ...
    waiting_a = asyncio.create_task(a.acquire(1.0))  # ... and gives it back before its next one
    await asyncio.wait_for(waiting_b, 1.0)  # b's deadline is earlier: b goes first
    assert grants.scheduler.running == "b" and not waiting_a.done()
    b.release()
    await asyncio.wait_for(waiting_a, 1.0)
    a.idle()
    a.close(), b.close(), grants.close()


async def _test_a_stuck_instance_is_taken_back_and_a_dead_one_forgotten() -> None:
    grants = DeviceGrants("cpu", TokenSchedulingConfig(enabled=True, max_iteration_s=0.05))
    a, b = pair(grants, "a"), pair(grants, "b")
    await a.acquire(1.0)  # lease
    task = asyncio.create_task(b.acquire(2.0))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(task, 1.0)  # a never gave the device back: taken back after 50 ms
    a.close()  # a dies
    await asyncio.sleep(0.01)
    assert "a" not in grants.instance_ids
    b.release()
    b.close(), grants.close()


async def _test_a_worker_speaking_out_of_turn_is_cut_off() -> None:
    grants = DeviceGrants("cpu")
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    grants.attach("rogue", agent_end)
    worker_end.send(encode(Message(Op.GRANT, 1.0)))  # only the agent grants
    await asyncio.sleep(0.01)
    assert grants.instance_ids == []
    worker_end.send(b"\x01")  # and malformed bytes on another: the same
    worker_end.close()
    agent_end.close()


def test_wire_rejects_malformed_messages() -> None:
    with pytest.raises(WireError, match="bytes"):
        decode(b"\x01\x01")
    with pytest.raises(WireError, match="version"):
        decode(b"\x02" + encode(Message(Op.WANT, 1.0))[1:])
    with pytest.raises(WireError, match="op"):
        decode(b"\x01\x09" + encode(Message(Op.WANT, 1.0))[2:])
    with pytest.raises(WireError, match="finite"):
        decode(encode(Message(Op.WANT, float("nan"))))
    assert decode(encode(Message(Op.WANT, 3.5))) == Message(Op.WANT, 3.5)


def test_config_from_env_fails_loudly() -> None:
    assert TokenSchedulingConfig.from_env({}).enabled is False
    assert TokenSchedulingConfig.from_env({"EMBER_TOKEN_SCHEDULING": "on"}).enabled is True
    with pytest.raises(ValueError, match="on or off"):
        TokenSchedulingConfig.from_env({"EMBER_TOKEN_SCHEDULING": "yes"})
    with pytest.raises(ValueError, match="seconds"):
        TokenSchedulingConfig.from_env({"EMBER_TOKEN_MAX_ITERATION_S": "soon"})


def test_iterations_of_co_located_instances_never_overlap_and_go_by_deadline() -> None:
    asyncio.run(_test_iterations_of_co_located_instances_never_overlap_and_go_by_deadline())


def test_a_lone_instance_runs_on_a_lease_until_another_asks() -> None:
    asyncio.run(_test_a_lone_instance_runs_on_a_lease_until_another_asks())


def test_a_stuck_instance_is_taken_back_and_a_dead_one_forgotten() -> None:
    asyncio.run(_test_a_stuck_instance_is_taken_back_and_a_dead_one_forgotten())


def test_a_worker_speaking_out_of_turn_is_cut_off() -> None:
    asyncio.run(_test_a_worker_speaking_out_of_turn_is_cut_off())
