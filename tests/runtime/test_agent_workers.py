"""The node agent's pre-warmed workers (issue 10): each has its own credential and inherits no
secret, a dead one is skipped at launch, and failing starts back off and show in the report.
Real processes: a pool daemon and ``python -m runtime`` workers serving the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.agent import AgentConfig, LaunchError, NodeAgent
from runtime.worker_guard import TOKEN_HEADER
from runtime.worker_spawn import BackoffConfig, SpawnBackoff
from scheduler.spec import parse_function
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

pytestmark = pytest.mark.slow

SECRETS = {
    "EMBER_API_KEY": "gateway-key",
    "EMBER_REDIS_URL": "redis://:hunter2@localhost:6379/0",
    "HF_TOKEN": "hf_abc",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "DB_PASSWORD": "pw",
}


def agent_config(home: Path, prewarm: int, **overrides: Any) -> AgentConfig:
    return AgentConfig(
        home=home, arena_bytes=64 << 20, prewarm=prewarm, node="n", pool_prefault=False,
        replenish_delay_s=0.0, worker_start_timeout_s=120.0, **overrides,
    )  # fmt: skip


def spec(name: str, model: dict[str, Any]) -> dict[str, Any]:
    return parse_function(
        {"apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": name},
         "spec": {"model": {"source": model["source"], "dtype": "float32"}}}
    ).to_document()  # fmt: skip


async def wait_warm(agent: NodeAgent, n: int, timeout: float = 180.0) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    while len(agent.warm()) < n:
        assert time.monotonic() < deadline, f"no {n} warm workers: {agent.spawn_errors}"
        await asyncio.sleep(0.1)
    return agent.warm()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_workers_inherit_no_secrets_need_their_credential_and_a_dead_one_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("EMBER_HARMLESS", "kept")
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))

    async def scenario() -> None:
        agent = NodeAgent(agent_config(tmp_path / "home", prewarm=2))
        try:
            await agent.start()
            model = await agent.ensure_model(str(tmp_path / "tiny.gguf"), "float32")
            warm = await wait_warm(agent, 2)
            for pid, url in warm:
                env = environ(pid)
                assert not set(SECRETS) & set(env) and env["EMBER_HARMLESS"] == "kept"
                cmdline = Path(f"/proc/{pid}/cmdline").read_text()
                assert not any(value in cmdline for value in SECRETS.values())
                async with httpx.AsyncClient(base_url=url) as http:
                    assert (await http.get("/healthz")).status_code == 200
                    refused = await http.post("/_ember/preload", json={"model_dir": model["dir"]})
                    assert refused.status_code == 401
            # A warm worker dies; the launch right after (before the agent reaped it) uses the other.
            victim = warm[0][0]
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.5)  # blocking: the agent's loop does not run, so it has not seen the exit
            document = spec("tiny", {"source": str(tmp_path / "tiny.gguf")})
            started = await agent.launch("1", document, model, agent.devices()[0], time.time() + 120)
            assert started.pid != victim and len(started.token) >= 32
            body = {"prompt": "abc", "max_tokens": 2, "temperature": 0}
            async with httpx.AsyncClient(base_url=started.url, timeout=60) as http:
                assert (await http.post("/v1/completions", json=body)).status_code == 401
                ok = await http.post("/v1/completions", json=body, headers={TOKEN_HEADER: started.token})
                assert ok.status_code == 200, ok.text
            # A second instance shares the cores: it is told its share in the assignment itself
            # (the first instance is told in the background), so it serves with it from the start.
            second = await agent.launch("2", document, model, agent.devices()[0], time.time() + 120)
            async with httpx.AsyncClient(base_url=second.url, timeout=60) as http:
                health = await http.get("/healthz", headers={TOKEN_HEADER: second.token})
                assert health.json()["num_threads"] == max(1, (os.cpu_count() or 1) // 2)
        finally:
            await agent.close()

    asyncio.run(scenario())


def test_failing_worker_starts_back_off_and_show_in_the_report(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = agent_config(tmp_path / "home", prewarm=1, backoff=BackoffConfig(initial_s=2.0, max_s=8.0))
        agent = NodeAgent(config)
        agent.adopt_template(str(tmp_path / "missing-model"))  # every worker fails to preload it
        try:
            await agent.start()
            deadline = time.monotonic() + 240
            while True:
                (record,) = (await agent.report()).values()
                if record["worker_failures"] >= 2:
                    break
                assert time.monotonic() < deadline, agent.spawn_errors
                await asyncio.sleep(0.2)
            assert "missing-model" in record["last_worker_error"]
            # Retried once after 2 s, then the delay doubled (4 s): no respawning in a tight loop.
            assert 2.0 < record["backoff_s"] <= 4.0 and record["warm_workers"] == 0
            t0 = time.monotonic()
            with pytest.raises(LaunchError, match="keep failing to start"):  # at once, not after 120 s
                await agent.launch("1", {}, {"dir": "x"}, agent.devices()[0], time.time() + 60)
            assert time.monotonic() - t0 < 5
        finally:
            await agent.close()

    asyncio.run(scenario())


def policies(pid: int) -> set[int]:
    """The scheduling policies of process ``pid``'s threads."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            out.add(os.sched_getscheduler(int(tid)))
    return out


def test_a_worker_starving_at_sched_idle_competes_after_the_idle_limit(tmp_path: Path) -> None:
    """Under a steady load a SCHED_IDLE start never finished (the pool was never replenished):
    after ``prewarm_idle_limit_s`` the starting worker is moved to SCHED_OTHER."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))

    async def observe(limit_s: float) -> tuple[bool, bool]:
        """(seen at SCHED_IDLE, then seen with every thread at SCHED_OTHER) while it starts.
        Before its own set_idle_priority the worker is SCHED_OTHER: only a change back counts."""
        agent = NodeAgent(agent_config(tmp_path / f"home-{limit_s}", prewarm=1, prewarm_idle_limit_s=limit_s))
        idle = moved = False
        try:
            await agent.start()
            deadline = time.monotonic() + 180
            while not agent.warm():
                assert time.monotonic() < deadline, agent.spawn_errors
                for pid in list(agent._workers._spawning):
                    with contextlib.suppress(OSError):
                        seen = policies(pid)
                        idle = idle or os.SCHED_IDLE in seen
                        moved = moved or (idle and seen == {os.SCHED_OTHER})
                await asyncio.sleep(0.05)
        finally:
            await agent.close()
        return idle, moved

    assert asyncio.run(observe(60.0)) == (True, False)  # the control: it pre-warms idle-class
    assert asyncio.run(observe(0.5)) == (True, True)


def test_backoff_doubles_up_to_its_cap_and_resets_on_success() -> None:
    backoff = SpawnBackoff(BackoffConfig(initial_s=1.0, max_s=60.0))
    assert [backoff.failed("boom") for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff.report()["worker_failures"] == 8 and backoff.report()["last_worker_error"] == "boom"
    backoff.succeeded()
    assert backoff.report() == {"worker_failures": 0, "backoff_s": 0.0, "last_worker_error": None}
    assert backoff.failed("again") == 1


def test_workers_start_one_at_a_time(tmp_path: Path) -> None:
    """Three pre-warmed workers start one after another (parallel_starts=1): started together
    on two cores they would all be ready late, and a waiting launch needs only the first."""
    from bench.procs import child_pids

    async def scenario() -> None:
        agent = NodeAgent(agent_config(tmp_path / "home", prewarm=3))
        most = 0
        try:
            await agent.start()
            deadline = time.monotonic() + 180
            while len(agent.warm()) < 3:
                assert time.monotonic() < deadline, f"no 3 warm workers: {agent.spawn_errors}"
                ready = {pid for pid, _ in agent.warm()}
                starting = set(child_pids(os.getpid(), "-m runtime")) - ready
                most = max(most, len(starting))
                await asyncio.sleep(0.02)
        finally:
            await agent.close()
        assert most == 1

    asyncio.run(scenario())
