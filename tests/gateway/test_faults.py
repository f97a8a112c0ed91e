"""Faults: a worker SIGKILLed mid-stream, and a Redis restart while idle."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.spawn import ServeProcess
from gpu_pool.client import PoolClient
from scheduler.redis_server import EmbeddedRedis
from tests.gateway.conftest import chat_spec, instances, wait_for

pytestmark = pytest.mark.slow

LONG = {
    "model": "faulty",
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    "max_tokens": 400,
    "temperature": 0,
    "stream": True,
}


def test_worker_killed_mid_stream(server: ServeProcess, http: httpx.Client) -> None:
    assert (
        http.post("/v1/functions", json=chat_spec("faulty", keep_alive="60s", max_scale=1)).status_code == 201
    )
    events: list[str] = []
    with http.stream("POST", "/v1/chat/completions", json=LONG) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:  # read until the first content arrives, then kill the worker
            if line.startswith("data: ") and '"content"' in line:
                break
        # Its record turns ready, with the worker's pid, once the activation's reply is in: the
        # worker sends it after its first request's first output (runtime.early_requests.Handover),
        # so a moment after the client has that output.
        wait_for(
            lambda: [i.get("pid") is not None for i in instances(http, "faulty")] == [True],
            timeout=10,
            interval=0.01,
        )
        (victim,) = instances(http, "faulty")
        os.kill(int(victim["pid"]), signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert len(errors) == 1 and json.loads(errors[0])["error"]["type"] == "instance_failed"
    assert events[-1] == "[DONE]"
    assert http.get("/healthz").json() == {"status": "ok"}  # the gateway stays up

    wait_for(lambda: all(i["id"] != victim["id"] for i in instances(http, "faulty")), timeout=10)
    body = {**LONG, "stream": False, "max_tokens": 8}
    again = http.post("/v1/chat/completions", json=body)
    assert again.status_code == 200, again.text
    (replacement,) = instances(http, "faulty")
    assert (
        replacement["id"] != victim["id"] and int(replacement["bytes_loaded"]) == 0
    )  # weights still resident
    with PoolClient(server.pool_socket) as pool:
        stats = pool.stats()
    # The dead worker's session is gone: one session for the live instance plus this observer.
    assert stats["sessions"] == 2
    assert http.delete("/v1/functions/faulty").status_code == 204


def _serving_workers(root: int) -> list[int]:
    """The pids of ``root``'s worker processes that are out of SCHED_IDLE: assigned ones and
    ready standbys (a pre-warmed worker waits at idle priority; this module's tests delete
    their functions, which ends their standbys)."""
    found, todo = [], [root]
    parents = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if entry.isdigit():
                parents[int(entry)] = int(
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                )
    while todo:
        parent = todo.pop()
        for pid in (p for p, pp in parents.items() if pp == parent):
            todo.append(pid)
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if (
                    b"runtime" in argv
                    and b"--parent-pid" in argv
                    and os.sched_getscheduler(pid) != os.SCHED_IDLE
                ):
                    found.append(pid)
    return found


def test_worker_killed_during_first_step(server: ServeProcess, http: httpx.Client) -> None:
    """A worker that dies while its instance's first request runs its first step, before the
    activation's reply (which waits for that first output): the instance died, the function
    did not fail to start. A request waiting for the function starts another instance."""
    wait_for(lambda: not _serving_workers(server.proc.pid), timeout=30)  # other tests' instances gone
    spec = chat_spec("racy", keep_alive="60s", max_scale=1, concurrency=1)
    assert http.post("/v1/functions", json=spec).status_code == 201
    words = " ".join(f"lighthouse{i % 50} keeper" for i in range(300))  # a first step of ~0.1-0.3 s
    first = {**LONG, "model": "racy", "messages": [{"role": "user", "content": "Summarize: " + words}]}
    second: dict[str, Any] = {}

    def wait_in_line() -> None:  # concurrency 1, maxScale 1: it waits for the function's instance
        short = {"model": "racy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=short, timeout=120)
        second.update(status=answer.status_code, text=answer.text)

    waiting = threading.Thread(target=wait_in_line)
    with http.stream("POST", "/v1/chat/completions", json=first) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:  # the role chunk: the first step runs now, the reply waits for it
            if line.startswith("data: "):
                break
        waiting.start()
        time.sleep(0.03)
        assert [i["state"] for i in instances(http, "racy")] == ["starting"]  # not recorded ready yet
        (victim,) = _serving_workers(server.proc.pid)
        os.kill(victim, signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert len(errors) == 1 and json.loads(errors[0])["error"]["type"] == "instance_failed"
    waiting.join(timeout=130)
    assert second.get("status") == 200, second  # not a 503 "failed to start"
    log = (server.home / "serve.log").read_text()
    assert "died before it was recorded ready" in log
    assert http.delete("/v1/functions/racy").status_code == 204


def test_redis_restart_while_idle(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    serve = ServeProcess(
        tmp_path / "home",
        env={"EMBER_ARENA": "1GiB", "EMBER_PREWARM": "1"},
        args=("--redis", redis_server.url),
    )
    try:
        with httpx.Client(base_url=serve.url, timeout=120) as http:
            assert http.post("/v1/functions", json=chat_spec("steady", keep_alive="30s")).status_code == 201
            ask = {"model": "steady", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            assert http.post("/v1/chat/completions", json=ask).status_code == 200
            redis_server.restart()  # stop + start on the same append-only file
            assert [f["metadata"]["name"] for f in http.get("/v1/functions").json()["functions"]] == [
                "steady"
            ]
            assert http.post("/v1/chat/completions", json=ask).status_code == 200
    finally:
        assert serve.stop() == 0


def test_a_second_serve_on_the_same_home_refuses_and_leaves_the_first_alone(
    server: ServeProcess, http: httpx.Client
) -> None:
    from gateway.spawn import ServeError

    with pytest.raises(ServeError, match="another `ember serve` is running"):
        ServeProcess(server.home, env={"EMBER_ARENA": "64MiB", "EMBER_PREWARM": "0"}, timeout=60)
    assert http.get("/healthz").json() == {"status": "ok"}
    assert (server.home / "serve.json").is_file()  # the running server's record is intact
