"""A pre-warmed worker still starting leaves SCHED_IDLE only while no other is ready
(runtime.warm_pool.WarmPool._age): boosted beside a ready one, it would take the cores from the
instances serving for nothing the next cold start needs."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from runtime.warm_pool import WarmPool
from runtime.worker_client import WorkerClient
from runtime.worker_handle import WorkerHandle
from tests.runtime.test_agent_workers import agent_config

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or os.geteuid() != 0,
    reason="leaving SCHED_IDLE needs Linux and CAP_SYS_NICE (the agent of a root ember serve)",
)


async def _policy_after_aging(home: Path, another_ready: bool) -> int:
    pool = WarmPool(agent_config(home, 2, prewarm_idle_limit_s=0.05), WorkerClient(5.0), list)
    starting = await asyncio.create_subprocess_exec("sleep", "30")  # a real process, still starting
    ready = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        os.sched_setscheduler(starting.pid, os.SCHED_IDLE, os.sched_param(0))
        pool._spawning[starting.pid] = starting
        if another_ready:
            pool._warm.append(WorkerHandle(ready, "http://127.0.0.1:1", home / "w.log", "t"))
        aging = asyncio.create_task(pool._age(starting.pid))
        await asyncio.sleep(0.4)  # several periods
        policy = os.sched_getscheduler(starting.pid)
        aging.cancel()
        return policy
    finally:
        for proc in (starting, ready):
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("another_ready", [True, False])
def test_a_starting_worker_is_boosted_only_when_none_is_ready(tmp_path: Path, another_ready: bool) -> None:
    policy = asyncio.run(_policy_after_aging(tmp_path, another_ready))
    assert policy == (os.SCHED_IDLE if another_ready else os.SCHED_OTHER)
