"""The composition root assembles the embedded mode from real parts and tears all of it down."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from gateway.compose import build_embedded
from gateway.serve import ServeConfig


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A child that exited but was not reaped yet is gone for every purpose here.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_build_start_close_leaves_no_process(tmp_path: Path) -> None:
    config = ServeConfig(home=tmp_path / "home", arena_bytes=64 << 20, prewarm=0)
    config.home.mkdir()

    async def scenario() -> tuple[int, int, int]:
        node = build_embedded(config, api_key="k" * 24)
        try:
            await node.start()
            assert node.redis_server is not None and node.redis_server.pid is not None
            redis_pid = node.redis_server.pid
            pool_pid = node.agent.pools["cpu"].proc.pid
            assert node.agent.pools_alive()
            assert node.state.r.ping()
            # The wired app answers, with the key it was built with guarding the function routes.
            transport = httpx.ASGITransport(app=node.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://ember") as client:
                assert (await client.get("/healthz")).status_code == 200
                assert (await client.get("/v1/functions")).status_code == 401
                listed = await client.get("/v1/functions", headers={"Authorization": "Bearer " + "k" * 24})
                assert listed.status_code == 200
            return redis_pid, pool_pid, len(node.agent.devices())
        finally:
            await node.close()

    redis_pid, pool_pid, num_devices = asyncio.run(scenario())
    assert num_devices == 1
    assert _gone(redis_pid) and _gone(pool_pid)


def test_survivor_keep_is_read_from_the_environment_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    assert ServeConfig.from_env().survivor_keep_s == 30.0
    monkeypatch.setenv("EMBER_SURVIVOR_KEEP", "0")
    assert ServeConfig.from_env().survivor_keep_s == 0.0  # off: workers die with their pool
    for bad in ("soon", "-1", "3601"):
        monkeypatch.setenv("EMBER_SURVIVOR_KEEP", bad)
        with pytest.raises(ValueError, match="EMBER_SURVIVOR_KEEP"):
            ServeConfig.from_env()
