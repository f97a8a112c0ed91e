"""Requests sent to a worker before its activation ended (pipelined activation): the worker
holds one that names its instance until the assign ends, then serves it, or answers 503
``not_started`` (it never ran) when the worker did not become that instance. Bounds of the
hold without processes; the rest with a real agent, pool daemon and ``python -m runtime``
workers serving the tiny model."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from runtime.early_requests import INSTANCE_HEADER, MAX_HELD, NEVER_RAN_HEADER, NOT_STARTED, EarlyRequests
from runtime.mesh.config import TokenSchedulingConfig
from runtime.worker_guard import TOKEN_HEADER
from scheduler import launcher
from tests.runtime.test_agent_workers import spec, wait_warm
from tests.runtime.test_standby import (
    FLAKY,
    PROMPT,
    complete,
    custom_function,
    leave_standby,
    started_agent,
    wait_standby,
)
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf
from tests.runtime.worker_proc import running_worker


def test_the_runtime_and_the_scheduler_agree_on_the_wire_names() -> None:
    ours = (INSTANCE_HEADER, NEVER_RAN_HEADER, NOT_STARTED)
    assert ours == (launcher.INSTANCE_HEADER, launcher.NEVER_RAN_HEADER, launcher.NOT_STARTED)
    assert MAX_HELD >= launcher.MAX_EARLY


def test_a_hold_ends_with_the_assign_or_at_its_bounds() -> None:
    async def scenario() -> None:
        early = EarlyRequests(max_held=2, max_hold_s=5.0)
        first = asyncio.ensure_future(early.hold(None))
        second = asyncio.ensure_future(early.hold(f"{time.time() + 5:.3f}"))
        await asyncio.sleep(0.05)
        assert early.num_held == 2
        assert await early.hold(None) is False  # a third: over max_held, answered at once
        early.ended()
        assert await first is True and await second is True and early.num_held == 0
        # A deadline already past, or one that passes first, ends the hold with False.
        assert await early.hold(f"{time.time() - 1:.3f}") is False
        t0 = time.monotonic()
        assert await early.hold(f"{time.time() + 0.1:.3f}") is False
        assert 0.05 < time.monotonic() - t0 < 2.0 and early.num_held == 0
        assert await early.hold("nan") is False
        # can_hold says what hold would do now; a request read ahead of its hold counts as held.
        assert early.can_hold(None) and early.can_hold(f"{time.time() + 5:.3f}")
        assert not early.can_hold(f"{time.time() - 1:.3f}")
        with early.reading(), early.reading():
            assert early.num_held == 2 and not early.can_hold(None)
            assert await early.hold(None) is False
        assert early.num_held == 0 and early.can_hold(None)
        # A deadline that is not a number holds for max_hold_s at most.
        quick = EarlyRequests(max_hold_s=0.05)
        assert await quick.hold("soon") is False
        later = asyncio.ensure_future(quick.hold(None))
        await asyncio.sleep(0)
        quick.ended()
        assert await later is True
        # A failed assign wakes the held requests, and nothing is held after it: the worker
        # is about to be ended, and no assign will come.
        held = asyncio.ensure_future(early.hold(None))
        await asyncio.sleep(0)
        early.refuse()
        early.ended()
        assert await held is True and early.refusing
        t0 = time.monotonic()
        assert await early.hold(None) is False and time.monotonic() - t0 < 0.5
        early.ended()  # a later end does not undo it
        assert await early.hold(None) is False

    asyncio.run(scenario())
    with pytest.raises(ValueError):
        EarlyRequests(max_held=0)
    with pytest.raises(ValueError):
        EarlyRequests(max_hold_s=0.0)


def test_the_requests_an_assign_woke_make_its_handover_until_each_releases_its_share() -> None:
    async def scenario() -> None:
        early = EarlyRequests(max_hold_s=5.0)
        held = [asyncio.ensure_future(early.hold_share(None)) for _ in range(3)]
        await asyncio.sleep(0)
        handover = early.ended()
        assert handover.num_pending == 3
        first, second, third = [await h for h in held]
        assert first is not None and second is not None and third is not None
        # Released once each, however often: a share given on is released by its new holder.
        first.release()
        first.release()
        given = second.transfer()
        second.release()
        assert handover.num_pending == 2
        waiting = asyncio.ensure_future(handover.wait(5.0))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        given.release()
        third.release()
        assert await waiting < 1.0 and handover.num_pending == 0
        # Nobody woken: nothing to wait for.
        assert await early.ended().wait(5.0) < 0.5
        # A share never released: the wait ends at its bound.
        late = asyncio.ensure_future(early.hold_share(None))
        await asyncio.sleep(0)
        stuck = early.ended()
        assert await late is not None
        assert 0.05 <= await stuck.wait(0.05) < 1.0 and stuck.num_pending == 1
        # A request counted as the assign ended, but cancelled before it woke, releases its part;
        # one that timed out before the end is not counted.
        gone = asyncio.ensure_future(early.hold_share(None))
        timed_out = asyncio.ensure_future(early.hold_share(f"{time.time() + 0.05:.3f}"))
        await asyncio.sleep(0.2)
        assert await timed_out is None
        handover = early.ended()
        assert handover.num_pending == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert handover.num_pending == 0 and early.num_held == 0
        # hold() (the bool form) releases its share at once.
        plain = asyncio.ensure_future(early.hold(None))
        await asyncio.sleep(0)
        handover = early.ended()
        assert await plain is True and handover.num_pending == 0

    asyncio.run(scenario())


class EarlyRequest:
    """A completion sent on a raw socket from ``on_target`` itself, so its bytes are in the
    worker's socket before the agent sends the assign (the worker is idle: it reads them first)."""

    def __init__(self, instance_id: str, path: str = "/v1/completions", body: Any = PROMPT) -> None:
        self.instance_id = instance_id
        self.path = path
        self.body = json.dumps(body).encode()
        self.sock: socket.socket | None = None
        self.targets: list[str] = []

    def __call__(self, url: str, token: str) -> None:
        self.targets.append(url)
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
        head = (
            f"POST {self.path} HTTP/1.1\r\nhost: {parts.hostname}\r\ncontent-type: application/json\r\n"
            f"{TOKEN_HEADER}: {token}\r\n{INSTANCE_HEADER}: {self.instance_id}\r\n"
            f"x-ember-deadline: {time.time() + 60:.3f}\r\ncontent-length: {len(self.body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.sock.sendall(head.encode() + self.body)

    async def rest(self) -> bytes:
        """What is left of the response, read to its end (the connection closes)."""
        sock = self.sock
        assert sock is not None, "on_target was never told a worker"

        def read() -> bytes:
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            sock.close()
            return b"".join(chunks)

        return await asyncio.to_thread(read)

    async def answer(self) -> tuple[int, dict[str, Any]]:
        """The response's status and JSON body (its never-ran header as ``never_ran``)."""
        raw = await self.rest()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), {**json.loads(body), "never_ran": headers.get(NEVER_RAN_HEADER)}


@pytest.mark.slow
def test_a_request_sent_before_the_activation_is_held_then_served(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    source = str(tmp_path / "tiny.gguf")

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", source) as (agent, model, device):
            document = spec("tiny", {"source": source})
            await wait_warm(agent, 1)
            # A pre-warmed worker's assign: the request came first and was held.
            early = EarlyRequest("1")
            first = await agent.launch("1", document, model, device, time.time() + 120, early)
            assert early.targets == [first.url]
            status, body = await early.answer()
            assert status == 200, body
            expected = await complete(first.url, first.token)
            assert body["choices"][0]["text"] == expected

            # A standby's activation, the common resident cold start: the same.
            await wait_warm(agent, 1)
            await agent.stop("1", standby=True)
            await wait_standby(agent, 1)
            early = EarlyRequest("2")
            second = await agent.launch("2", document, model, device, time.time() + 120, early)
            assert "activate_ms" in second.timings_ms and early.targets == [second.url]
            status, body = await early.answer()
            assert status == 200, body
            assert body["choices"][0]["text"] == expected

            # A held stream's first output is taken before the activation's reply goes
            # (runtime.early_requests.Handover): the launch returns with its response begun.
            await wait_warm(agent, 1)
            await agent.stop("2", standby=True)
            await wait_standby(agent, 1)
            streamed = EarlyRequest("4", body={**PROMPT, "stream": True})
            fourth = await agent.launch("4", document, model, device, time.time() + 120, streamed)
            assert fourth.timings_ms["handover_wait_ms"] > 0
            assert streamed.sock is not None
            sent = streamed.sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            assert b"200 OK" in sent, sent  # (its first output may hold no text yet: no chunk)
            rest = await streamed.rest()
            assert b"data: [DONE]" in rest and rest.endswith(b"\r\n0\r\n\r\n"), rest[-200:]  # (chunked)

            # A request that names another instance never runs here.
            await wait_warm(agent, 1)
            early = EarlyRequest("not-this-one")
            third = await agent.launch("3", document, model, device, time.time() + 120, early)
            status, body = await early.answer()
            assert status == 503 and body["error"]["type"] == NOT_STARTED, body
            assert body["never_ran"] == "not-this-one"
            assert await complete(third.url, third.token) == expected

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_token_scheduled_start_replies_without_waiting_for_its_held_requests(tmp_path: Path) -> None:
    """With the agent's token scheduler, a held request is admitted and stepped only once the
    agent attached the instance, which it does on the assign's reply: the reply does not wait
    for the request's first output (it waited out its whole bound, 0.5 s)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    source = str(tmp_path / "tiny.gguf")
    tokens = TokenSchedulingConfig(enabled=True)

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", source, standby=0, tokens=tokens) as (
            agent,
            model,
            device,
        ):
            await wait_warm(agent, 1)
            early = EarlyRequest("1")
            started = await agent.launch(
                "1", spec("tiny", {"source": source}), model, device, time.time() + 120, early
            )
            assert "handover_wait_ms" not in started.timings_ms, started.timings_ms
            status, body = await early.answer()
            assert status == 200 and body["choices"][0]["text"], body

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_request_held_by_a_failed_activation_is_answered_that_it_never_ran(tmp_path: Path) -> None:
    home, document, source = custom_function(tmp_path, "flaky", FLAKY)

    async def scenario() -> None:
        async with started_agent(home, source) as (agent, model, device):
            await leave_standby(agent, document, model, device)
            # The standby's initializer fails: the worker is ended, and the request it held
            # is told it never ran (the gateway routes it again) before the connection closes.
            early = EarlyRequest("2", "/invoke", {"x": 1})
            with pytest.raises(Exception, match="initializer fails"):
                await agent.launch("2", document, model, device, time.time() + 120, early)
            status, body = await early.answer()
            assert status == 503 and body["error"]["type"] == NOT_STARTED, body
            assert body["never_ran"] == "2"

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_worker_whose_assign_failed_holds_nothing_more(tmp_path: Path) -> None:
    """An assign the worker refused (here: malformed) means the agent ends it: a request that
    names an instance is answered at once that it never ran, not held until its deadline (that
    would hold up the worker's exit). The rehearsal's empty assign does not count."""
    home = tmp_path / "home"
    home.mkdir()
    with running_worker(home) as worker:
        early = {**worker.headers, INSTANCE_HEADER: "1", "x-ember-deadline": f"{time.time() + 0.5:.3f}"}
        with httpx.Client(base_url=worker.url, timeout=30) as http:
            # Rehearsed (an empty assign was refused before it was ready): it still holds, until
            # the deadline here, as no assign comes.
            t0 = time.monotonic()
            held = http.post("/v1/completions", json=PROMPT, headers=early)
            assert held.status_code == 503 and time.monotonic() - t0 >= 0.4
            assert http.post("/_ember/assign", content=b"{}", headers=worker.headers).status_code == 400
            t0 = time.monotonic()
            early["x-ember-deadline"] = f"{time.time() + 30:.3f}"
            refused = http.post("/v1/completions", json=PROMPT, headers=early)
            assert refused.status_code == 503 and refused.headers[NEVER_RAN_HEADER] == "1"
            assert refused.json()["error"]["type"] == NOT_STARTED and time.monotonic() - t0 < 5.0


@pytest.mark.slow
def test_a_request_sent_to_a_standby_is_read_and_checked_before_its_activation(tmp_path: Path) -> None:
    """A standby of the default handler reads, parses and tokenizes a request that names the
    instance it will become while it waits (the activation's pool round trip then overlaps
    it): a malformed one is answered at once, not held for an assign that may never come. A
    well-formed one is served by the activated instance, also when the activation rebuilt
    the engine on new placements (it is prepared again with the new binding)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    write_tiny_gguf(tmp_path / "other.gguf", hf_weights(4))
    source = str(tmp_path / "tiny.gguf")

    async def scenario() -> None:
        async with started_agent(tmp_path / "home", source) as (agent, model, device):
            document = spec("tiny", {"source": source})
            await wait_warm(agent, 1)
            first = await agent.launch("1", document, model, device, time.time() + 120)
            expected = await complete(first.url, first.token)
            await wait_warm(agent, 1)
            await agent.stop("1", standby=True)
            await wait_standby(agent, 1)
            (standby,) = agent._standbys._ready.values()
            early = {
                **standby.worker.headers,
                INSTANCE_HEADER: "2",
                "x-ember-deadline": f"{time.time() + 20:.3f}",
            }
            async with httpx.AsyncClient(base_url=standby.worker.url, timeout=30) as http:
                t0 = time.monotonic()
                bad = await http.post("/v1/completions", json={**PROMPT, "max_tokens": "many"}, headers=early)
                assert bad.status_code == 400 and time.monotonic() - t0 < 5.0, bad.text
                assert bad.json()["error"]["param"] == "max_tokens"
                not_json = await http.post("/v1/completions", content=b"{", headers=early)
                assert not_json.status_code == 400 and time.monotonic() - t0 < 10.0, not_json.text
                # One it would not hold (its deadline passed) is not read ahead: it never ran.
                late = {**early, "x-ember-deadline": f"{time.time() - 1:.3f}"}
                never = await http.post("/v1/completions", content=b"{", headers=late)
                assert never.status_code == 503 and never.headers[NEVER_RAN_HEADER] == "2", never.text

            # The model is evicted and another takes its place: the activation rebuilds the
            # engine on new placements, and the request read ahead is served by the new one.
            assert await agent.evict(model["id"]) > 0
            other = await agent.ensure_model(str(tmp_path / "other.gguf"), "float32")
            other_doc = spec("other", {"source": str(tmp_path / "other.gguf")})
            await wait_warm(agent, 1)
            await agent.launch("3", other_doc, other, device, time.time() + 120)
            request = EarlyRequest("2")
            second = await agent.launch("2", document, model, device, time.time() + 120, request)
            assert "activate_ms" in second.timings_ms and "build_ms" in second.timings_ms
            status, body = await request.answer()
            assert status == 200, body
            assert body["choices"][0]["text"] == expected

    asyncio.run(scenario())
