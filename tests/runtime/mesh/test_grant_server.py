"""The agent's token scheduler and the workers' gates over real socketpairs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from runtime.mesh.admission import InstanceView, admit
from runtime.mesh.config import TokenSchedulingConfig
from runtime.mesh.gate import Gate
from runtime.mesh.grant_server import MAX_BATCH, DeviceGrants
from runtime.mesh.slo import Slo
from runtime.mesh.state_page import MAX_ENTRIES, PAGE_BYTES, Entry, StatePage
from runtime.mesh.time_table import TimeTable
from runtime.mesh.wire import SIZE, Message, Op, WireError, decode, encode


def view(table: TimeTable | None = None, slo: Slo | None = None) -> tuple[InstanceView, StatePage]:
    """An instance's view for the agent and the page its engine writes (one buffer)."""
    buf = memoryview(bytearray(PAGE_BYTES))
    return InstanceView(StatePage(buf), table, slo or Slo(), 4096), StatePage(buf)


def pair(grants: DeviceGrants, instance_id: str, table: TimeTable | None = None) -> Gate:
    """A gate whose agent end ``grants`` schedules (the agent end is closed after the test;
    in the agent the worker's handle owns it)."""
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent_view, page = view(table)
    grants.attach(instance_id, agent_end, agent_view)
    AGENT_ENDS.append(agent_end)
    return Gate(worker_end, page)


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
    grants.attach("rogue", agent_end, view()[0])
    worker_end.send(encode(Message(Op.GRANT, 1.0)))  # only the agent grants
    await asyncio.sleep(0.01)
    assert grants.instance_ids == []
    assert worker_end.recv(SIZE) == b""  # shut down: its gate learns it is on its own
    other_agent_end, other_worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    grants.attach("garbled", other_agent_end, view()[0])
    other_worker_end.send(b"\x01")  # and malformed bytes on another: the same
    await asyncio.sleep(0.01)
    assert grants.instance_ids == [] and other_worker_end.recv(SIZE) == b""
    for sock in (worker_end, agent_end, other_worker_end, other_agent_end):
        sock.close()


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
    assert TokenSchedulingConfig.from_env({"EMBER_TOKEN_MAX_PASSED_OVER": "3"}).max_passed_over == 3
    with pytest.raises(ValueError, match="count"):
        TokenSchedulingConfig.from_env({"EMBER_TOKEN_MAX_PASSED_OVER": "many"})
    with pytest.raises(ValueError, match="max_passed_over"):
        TokenSchedulingConfig.from_env({"EMBER_TOKEN_MAX_PASSED_OVER": "0"})


def test_iterations_of_co_located_instances_never_overlap_and_go_by_deadline() -> None:
    asyncio.run(_test_iterations_of_co_located_instances_never_overlap_and_go_by_deadline())


def test_a_lone_instance_runs_on_a_lease_until_another_asks() -> None:
    asyncio.run(_test_a_lone_instance_runs_on_a_lease_until_another_asks())


def test_a_stuck_instance_is_taken_back_and_a_dead_one_forgotten() -> None:
    asyncio.run(_test_a_stuck_instance_is_taken_back_and_a_dead_one_forgotten())


def test_a_worker_speaking_out_of_turn_is_cut_off() -> None:
    asyncio.run(_test_a_worker_speaking_out_of_turn_is_cut_off())


def flat_table(prefill_per_token_s: float, decode_s: float) -> TimeTable:
    return TimeTable(
        (1, 1024), (prefill_per_token_s, prefill_per_token_s * 1024), (1, 64), (1, 4096),
        ((decode_s, decode_s), (decode_s, decode_s)),
    )  # fmt: skip


async def _test_admission_reads_every_instance_page_and_refuses_what_would_break_an_slo() -> None:
    grants = DeviceGrants("cpu")
    table = flat_table(0.001, 0.01)  # 1 ms per prompt token
    a, b = pair(grants, "a", table), pair(grants, "b", table)
    assert await a.admit(100) == 0  # an idle device: 0.11 s of prefill fits the 2 s TTFT
    # b holds a 1500-token prompt waiting for its prefill (1.65 s with the margin), due in
    # 2.43 s (its TTFT SLO is 1500 / 512 s). A 1000-token request on a is due sooner (2 s), so
    # it would run first (1.1 s) and b's first token would come at 2.75 s: case 2.
    assert b.page is not None
    b.page.write(0.0, [Entry(time.monotonic() - 0.5, 1500, 0)])
    assert await a.admit(1000) == 2
    assert await a.admit(100) == 0  # 0.11 s first: b still in time
    assert grants.num_admitted == 2 and grants.num_refused == 1
    c = pair(grants, "c", flat_table(0.01, 0.01))  # 10 ms per prompt token
    assert await c.admit(1000) == 1  # case 1: 11 s of prefill against a 2 s TTFT SLO
    assert grants.num_refused == 2
    b.page.write(0.0, [])  # b's request is done: on an empty device refusing protects nobody
    assert await c.admit(1000) == 0
    for g in (a, b, c):
        g.close()
    grants.close()


def test_admission_reads_every_instance_page_and_refuses_what_would_break_an_slo() -> None:
    asyncio.run(_test_admission_reads_every_instance_page_and_refuses_what_would_break_an_slo())


async def _test_a_request_that_goes_away_while_waiting_leaves_nothing_behind() -> None:
    """A cancelled admission's verdict, and a grant for an engine that stopped waiting, are
    handed back: the gate stays usable and the device is not held by nobody."""
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    grants = DeviceGrants("cpu")
    a, b = pair(grants, "a"), pair(grants, "b")
    asking = asyncio.create_task(a.admit(10))
    await asyncio.sleep(0)  # ADMIT sent, waiting for the verdict ...
    asking.cancel()  # ... when its client goes away
    await asyncio.sleep(0.01)
    assert await a.admit(10) == 0 and not errors
    await a.acquire(1.0)  # a holds the device (leased) ...
    waiting = asyncio.create_task(b.acquire(2.0))
    await asyncio.sleep(0.01)
    waiting.cancel()  # ... b's engine stops waiting (it closes)
    await asyncio.sleep(0.01)
    a.release()
    await asyncio.wait_for(a.acquire(1.0), 1.0)  # b's grant came back at once, not after 30 s
    assert grants.scheduler.running == "a" and not errors
    a.idle()
    a.close(), b.close(), grants.close()


def test_a_request_that_goes_away_while_waiting_leaves_nothing_behind() -> None:
    asyncio.run(_test_a_request_that_goes_away_while_waiting_leaves_nothing_behind())


def _sends_that_fit(sock: socket.socket) -> int:
    """How many messages ``sock`` sends before its buffer is full (the peer reads none)."""
    probe, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    probe.setblocking(False)
    count = 0
    with probe, peer:
        try:
            while True:
                probe.send(encode(Message(Op.VERDICT)))
                count += 1
        except BlockingIOError:
            return count


async def _test_a_worker_cut_off_mid_batch_is_not_scheduled_again() -> None:
    # The worker asks for admissions and never reads a verdict: the agent's send fails and it
    # is detached. What it queued after that must neither bring it back (a grant for an
    # instance that is gone holds the device) nor raise out of the agent's callback.
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    grants = DeviceGrants("cpu", TokenSchedulingConfig(enabled=True, max_iteration_s=3600))
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    AGENT_ENDS.append(agent_end)
    agent_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # the minimum: fills fast
    for _ in range(_sends_that_fit(agent_end) + 2):
        worker_end.send(encode(Message(Op.ADMIT, 10.0)))
        worker_end.send(encode(Message(Op.WANT, 1.0)))
    grants.attach("rogue", agent_end, view()[0])
    await asyncio.sleep(0.05)
    assert grants.instance_ids == []
    assert grants.scheduler.running is None and not grants.scheduler.waiting
    assert errors == []
    # The worker learns it: after the verdicts sent, its end reads closed (its gate then runs
    # the instance on its own instead of waiting for a grant forever).
    worker_end.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while worker_end.recv(SIZE):
            pass
    assert worker_end.recv(SIZE) == b""
    worker_end.close()
    grants.close()


def test_a_worker_cut_off_mid_batch_is_not_scheduled_again() -> None:
    asyncio.run(_test_a_worker_cut_off_mid_batch_is_not_scheduled_again())


async def _test_a_flooding_worker_gets_a_bounded_share_of_the_agents_loop() -> None:
    # Tenant code runs in the worker: it may refill its socket as fast as the agent drains it.
    # One wake-up of the agent handles a bounded batch, so its other callbacks run between.
    grants = DeviceGrants("cpu")
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    AGENT_ENDS.append(agent_end)
    worker_end.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            worker_end.send(encode(Message(Op.WANT, 1.0)))
            sent += 1
    assert sent > MAX_BATCH
    grants.attach("flood", agent_end, view()[0])
    grants._readable("flood")  # one wake-up of the agent's loop
    left = agent_end.recv(SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    assert decode(left) == Message(Op.WANT, 1.0)  # the rest waits for the next turn
    assert grants.instance_ids == ["flood"]
    worker_end.close()
    grants.close()


def test_a_flooding_worker_gets_a_bounded_share_of_the_agents_loop() -> None:
    asyncio.run(_test_a_flooding_worker_gets_a_bounded_share_of_the_agents_loop())


async def _test_a_cancelled_wait_for_a_verdict_or_a_grant_leaves_the_gate_working() -> None:
    # A request cancelled while it waits for admission (its client gone), an engine loop
    # cancelled while it waits for the device: the answer still comes. The gate must neither
    # raise out of its reader nor keep a device nobody will run on.
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    grants = DeviceGrants("cpu", TokenSchedulingConfig(enabled=True, max_iteration_s=3600))
    a, b = pair(grants, "a"), pair(grants, "b")
    asking = asyncio.create_task(a.admit(10))
    await asyncio.sleep(0)  # the ADMIT is sent
    asking.cancel()
    await asyncio.sleep(0.02)  # its verdict arrives
    assert await asyncio.wait_for(a.admit(10), 1.0) == 0
    await b.acquire(1.0)  # b holds the device (a lease)
    waiting = asyncio.create_task(a.acquire(2.0))
    await asyncio.sleep(0.02)
    waiting.cancel()
    b.release()  # b yields: the device is granted to a, whose wait was cancelled
    await asyncio.sleep(0.02)
    assert grants.scheduler.running is None  # a gave it back at once
    await asyncio.wait_for(b.acquire(1.0), 1.0)
    await asyncio.wait_for(a.admit(10), 1.0)
    assert errors == []
    a.close(), b.close(), grants.close()


def test_a_cancelled_wait_for_a_verdict_or_a_grant_leaves_the_gate_working() -> None:
    asyncio.run(_test_a_cancelled_wait_for_a_verdict_or_a_grant_leaves_the_gate_working())


async def _test_a_worker_claiming_the_earliest_deadline_forever_does_not_starve_its_neighbour() -> None:
    # Tenant code can speak for its worker: it gives every grant back at once and asks again
    # with a deadline nobody beats. Its neighbour still gets the device after a bounded number
    # of grants passed it over.
    grants = DeviceGrants("cpu", TokenSchedulingConfig(enabled=True, max_iteration_s=3600))
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    grants.attach("greedy", agent_end, view()[0])
    AGENT_ENDS.append(agent_end)
    loop = asyncio.get_running_loop()
    worker_end.setblocking(False)
    first = encode(Message(Op.WANT, -1e300))
    again = encode(Message(Op.DONE))

    def greedy() -> None:
        with contextlib.suppress(BlockingIOError):
            while decode(worker_end.recv(SIZE)).op is Op.GRANT:
                worker_end.send(again)
                worker_end.send(first)

    loop.add_reader(worker_end.fileno(), greedy)
    worker_end.send(first)
    honest = pair(grants, "honest")
    try:
        await asyncio.wait_for(honest.acquire(1.0), 2.0)
        honest.release()
        assert grants.scheduler.num_grants > 2
    finally:
        loop.remove_reader(worker_end.fileno())
        honest.close(), grants.close()
        worker_end.close()


def test_a_worker_claiming_the_earliest_deadline_forever_does_not_starve_its_neighbour() -> None:
    asyncio.run(_test_a_worker_claiming_the_earliest_deadline_forever_does_not_starve_its_neighbour())


async def _test_a_worker_flooding_costly_admissions_holds_the_agents_loop_briefly() -> None:
    # An ADMIT runs a shadow validation: with a full page of requests waiting for their
    # prefill, milliseconds each (more with neighbours). A wake-up of the agent's loop
    # stops after a short time budget, not after MAX_BATCH of them.
    grants = DeviceGrants("cpu")
    table = TimeTable((1, 1024), (1e-6, 1e-3), (1, 64), (1, 4096), ((1e-6, 1e-6), (1e-6, 1e-6)))
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    AGENT_ENDS.append(agent_end)
    agent_view, page = view(table, Slo(ttft_s=86399, tpot_s=1e-3))
    now = time.monotonic()
    page.write(4096.0, [Entry(now - 86398, 1, 0)] * MAX_ENTRIES)  # 128 prefills first, each cycle
    one = time.perf_counter()
    admit({"flood": agent_view}, "flood", 10, now)
    one = time.perf_counter() - one
    worker_end.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):
        while sent < MAX_BATCH:
            worker_end.send(encode(Message(Op.ADMIT, 10.0)))
            sent += 1
    grants.attach("flood", agent_end, agent_view)
    held = time.perf_counter()
    grants._readable("flood")  # one wake-up of the agent's loop
    held = time.perf_counter() - held
    assert held < 16 * one, f"one wake-up held the loop {held:.2f} s ({one * 1e3:.1f} ms an ADMIT)"
    worker_end.close()
    grants.close()


def test_a_worker_flooding_costly_admissions_holds_the_agents_loop_briefly() -> None:
    asyncio.run(_test_a_worker_flooding_costly_admissions_holds_the_agents_loop_briefly())
