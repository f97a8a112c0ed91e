"""The agent's control line to a worker (:mod:`runtime.control_line`): its encoding, a call and
its failures over a real socketpair, and a real agent's assign going over it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import control_line
from runtime.control_line import (
    KIND_ASSIGN,
    KIND_REPLY,
    KIND_SERVING,
    Caller,
    ExitedServing,
    LineServer,
    decode,
    encode,
    new_pair,
)
from runtime.worker_client import WorkerCallFailed, WorkerReply, WorkerUnreachable
from tests.runtime.test_agent_workers import spec, wait_warm
from tests.runtime.test_standby import complete, started_agent, wait_standby
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

Then = Callable[[], Awaitable[None]] | None


@settings(deadline=None)
@given(
    st.sampled_from([KIND_ASSIGN, KIND_REPLY, KIND_SERVING]),
    st.integers(0, 2**32 - 1),
    st.integers(0, 599),
    st.binary(max_size=2048),
)
def test_a_message_decodes_to_what_was_encoded(kind: int, call_id: int, status: int, body: bytes) -> None:
    assert decode(encode(kind, call_id, status, body)) == (kind, call_id, status, body)


def test_what_is_not_a_message_of_this_version_is_refused() -> None:
    good = encode(KIND_ASSIGN, 7, 0, b"{}")
    for raw, why in (
        (good[:5], "at least"),
        (b"HTTP" + good[4:], "magic"),
        (good[:4] + bytes([control_line.VERSION + 1]) + good[5:], "version"),
        (good[:5] + bytes([9]) + good[6:], "kind"),
    ):
        with pytest.raises(ValueError, match=why):
            decode(raw)
    with pytest.raises(ValueError, match="at most"):
        encode(KIND_ASSIGN, 1, 0, b"x" * (control_line.MAX_BODY_BYTES + 1))
    assert control_line.fits(b"x" * control_line.MAX_BODY_BYTES)
    assert not control_line.fits(b"x" * (control_line.MAX_BODY_BYTES + 1))


def test_a_call_gets_the_workers_answer_and_the_then_task_runs_after_the_reply() -> None:
    async def scenario() -> None:
        agent_end, worker_end = new_pair()
        done: list[str] = []

        async def handler(body: bytes, serving: Callable[[], None]) -> tuple[int, bytes, Then]:
            async def then() -> None:
                done.append("then")

            doc = json.loads(body)
            return (200 if doc["ok"] else 409), json.dumps({"echo": doc}).encode(), then

        server = LineServer(worker_end, handler)
        server.start()
        caller = Caller(agent_end)
        try:
            reply = await caller.assign(b'{"ok": true}', 5.0)
            assert reply.status == 200 and json.loads(reply.content) == {"echo": {"ok": True}}
            reply = await caller.assign(b'{"ok": false}', 5.0)
            assert reply.status == 409 and caller.num_calls == 2
            await asyncio.sleep(0.05)
            assert done == ["then", "then"]
            # A malformed message is answered 400 when its id can be read, and the line serves on.
            agent_end.send(control_line.HEADER.pack(b"EMBc", 99, KIND_ASSIGN, 41, 0))
            bad = decode(await asyncio.get_running_loop().sock_recv(agent_end, 65536))
            assert (bad.kind, bad.call_id, bad.status) == (KIND_REPLY, 41, 400)
            assert json.loads(bad.body)["error"]["type"] == "invalid_request_error"
            agent_end.send(b"junk")  # too short to answer: dropped
            assert (await caller.assign(b'{"ok": true}', 5.0)).status == 200
        finally:
            server.close()
            caller.close()

    asyncio.run(scenario())


def test_a_call_fails_typed_when_the_line_or_the_worker_fails() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        # A reply to an earlier call (given up on) is dropped; the call's own is returned.
        agent_end, worker_end = new_pair()
        caller = Caller(agent_end)
        call = asyncio.ensure_future(caller.assign(b"{}", 5.0))
        sent = decode(await loop.run_in_executor(None, worker_end.recv, 65536))
        worker_end.send(encode(KIND_REPLY, (sent.call_id + 1) % 2**32, 500, b"stale"))
        worker_end.send(encode(KIND_REPLY, sent.call_id, 200, b"fresh"))
        assert (await call).content == b"fresh"
        # No reply in time: the call failed after it may have been delivered.
        with pytest.raises(WorkerCallFailed, match="within"):
            await caller.assign(b"{}", 0.05)
        # The worker exits after taking the call: failed, not undelivered.
        call = asyncio.ensure_future(caller.assign(b"{}", 5.0))
        await loop.run_in_executor(None, worker_end.recv, 65536)
        worker_end.close()
        with pytest.raises(WorkerCallFailed, match="control line"):
            await call
        # The worker is gone before the call: nothing was delivered.
        with pytest.raises(WorkerUnreachable):
            await caller.assign(b"{}", 5.0)
        assert caller.num_calls == 3
        caller.close()
        # A message the line cannot queue whole: refused, nothing delivered (then over HTTP).
        agent_end, worker_end = new_pair()
        agent_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        small = Caller(agent_end)
        with pytest.raises(control_line.LineTooSmall):
            await small.assign(b"x" * control_line.MAX_BODY_BYTES, 5.0)
        assert small.num_calls == 0
        # The agent closes its end while a call waits for its reply: it fails at once.
        call = asyncio.ensure_future(small.assign(b"{}", 30.0))
        await loop.run_in_executor(None, worker_end.recv, 65536)
        t0 = time.monotonic()
        small.close()
        with pytest.raises(WorkerCallFailed):
            await call
        assert time.monotonic() - t0 < 10.0
        worker_end.close()

    asyncio.run(scenario())


def test_a_failing_handler_is_answered_and_the_line_serves_on() -> None:
    async def scenario() -> None:
        agent_end, worker_end = new_pair()
        calls: list[bytes] = []

        async def handler(body: bytes, serving: Callable[[], None]) -> tuple[int, bytes, Then]:
            calls.append(body)
            if body == b"raise":
                raise RuntimeError("a bug")

            async def then() -> None:
                raise OSError("the work after the reply failed")

            return 200, b"{}", then

        server = LineServer(worker_end, handler)
        server.start()
        caller = Caller(agent_end)
        try:
            failed = await caller.assign(b"raise", 5.0)
            assert failed.status == 500 and "a bug" in json.loads(failed.content)["error"]["message"]
            assert (await caller.assign(b"ok", 5.0)).status == 200  # its then-task fails: logged
            assert (await caller.assign(b"ok", 5.0)).status == 200 and calls == [b"raise", b"ok", b"ok"]
        finally:
            server.close()
            caller.close()

    asyncio.run(scenario())


async def _call_in_flight(
    caller: Caller, worker_end: socket.socket
) -> tuple[asyncio.Future[WorkerReply], int]:
    """An assign in flight on ``caller``'s line, and its id as ``worker_end`` received it."""
    call = asyncio.ensure_future(caller.assign(b"{}", 5.0))
    sent = decode(await asyncio.get_running_loop().run_in_executor(None, worker_end.recv, 65536))
    return call, sent.call_id


def test_a_worker_that_exits_after_it_said_it_serves_ended_serving() -> None:
    async def scenario() -> None:
        agent_end, worker_end = new_pair()
        caller = Caller(agent_end)
        # It says it serves, then replies: the reply is the call's answer.
        call, call_id = await _call_in_flight(caller, worker_end)
        worker_end.send(encode(KIND_SERVING, (call_id + 1) % 2**32, 0, b""))  # another call's
        worker_end.send(encode(KIND_SERVING, call_id, 0, b""))
        worker_end.send(encode(KIND_REPLY, call_id, 200, b"done"))
        assert (await call).content == b"done"
        # Another call's SERVING says nothing of this one: an exit is a failed call.
        call, call_id = await _call_in_flight(caller, worker_end)
        worker_end.send(encode(KIND_SERVING, (call_id + 1) % 2**32, 0, b""))
        await asyncio.sleep(0.05)
        worker_end.close()
        with pytest.raises(WorkerCallFailed) as failed:
            await call
        assert not isinstance(failed.value, ExitedServing)
        caller.close()
        # It says it serves, then exits before its reply: it ended serving.
        agent_end, worker_end = new_pair()
        caller = Caller(agent_end)
        call, call_id = await _call_in_flight(caller, worker_end)
        worker_end.send(encode(KIND_SERVING, call_id, 0, b""))
        await asyncio.sleep(0.05)
        worker_end.close()
        with pytest.raises(ExitedServing):
            await call
        caller.close()

    asyncio.run(scenario())


def test_the_line_server_hands_its_handler_a_way_to_say_it_serves() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        agent_end, worker_end = new_pair()
        agent_end.setblocking(False)

        async def handler(body: bytes, serving: Callable[[], None]) -> tuple[int, bytes, Then]:
            serving()
            await asyncio.sleep(0.05)  # (the reply waits, as for the first outputs)
            return 200, body, None

        server = LineServer(worker_end, handler)
        server.start()
        try:
            await loop.sock_sendall(agent_end, encode(KIND_ASSIGN, 5, 0, b"{}"))
            first = decode(await loop.sock_recv(agent_end, 65536))
            second = decode(await loop.sock_recv(agent_end, 65536))
            assert (first.kind, first.call_id, first.body) == (KIND_SERVING, 5, b"")
            assert (second.kind, second.call_id, second.status, second.body) == (KIND_REPLY, 5, 200, b"{}")
        finally:
            server.close()
            agent_end.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_an_agent_assigns_its_workers_over_their_control_lines(tmp_path: Path) -> None:
    """A pre-warmed worker's assign and a standby's activation both go over the line, and the
    instances serve; a worker whose line the agent closed still takes its assign over HTTP."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    source = str(tmp_path / "tiny.gguf")

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", source) as (agent, model, device):
            document = spec("tiny", {"source": source})
            await wait_warm(agent, 1)
            first = await agent.launch("1", document, model, device, time.time() + 120)
            line = agent._instances["1"].control
            assert line is not None and line.num_calls == 1
            expected = await complete(first.url, first.token)
            await wait_warm(agent, 1)
            await agent.stop("1", standby=True)
            await wait_standby(agent, 1)
            (standby,) = agent._standbys._ready.values()
            standby_line = standby.worker.control
            assert standby_line is not None and standby_line.num_calls == 0  # (prepared over HTTP)
            second = await agent.launch("2", document, model, device, time.time() + 120)
            assert "activate_ms" in second.timings_ms and second.pid == standby.worker.pid
            assert standby_line.num_calls == 1 and await complete(second.url, second.token) == expected
            await wait_warm(agent, 1)
            # Over HTTP when the line is gone (a worker spawned without one takes it the same way).
            (ready,) = [w for w in agent._workers._warm if w.running]
            assert ready.control is not None
            ready.control.close()
            ready.control = None
            third = await agent.launch("3", document, model, device, time.time() + 120)
            assert third.pid == ready.pid and await complete(third.url, third.token) == expected

    asyncio.run(scenario())


def test_the_worker_side_of_a_line_ends_when_the_agent_closes_its_end() -> None:
    async def scenario() -> None:
        agent_end, worker_end = new_pair()

        async def handler(body: bytes, serving: Callable[[], None]) -> tuple[int, bytes, Then]:
            return 200, body, None

        server = LineServer(worker_end, handler)
        server.start()
        agent_end.close()
        assert server._task is not None
        await asyncio.wait_for(server._task, 5.0)
        server.close()
        assert worker_end.fileno() == -1

    asyncio.run(scenario())
