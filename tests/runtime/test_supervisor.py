"""runtime.supervisor: backoff delays, and a real child process restarted after SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from runtime.supervisor import Backoff, RestartConfig, SpawnThread, ThreadRestarted, supervise


def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run() -> None:
    backoff = Backoff(RestartConfig(initial_s=0.1, max_s=0.5, stable_s=60))
    assert [backoff.next_delay(0) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.up(100.0)
    assert backoff.next_delay(130.0) == 0.5  # died after 30 s: still backing off
    backoff.up(200.0)
    assert backoff.next_delay(260.0) == 0.1  # up a stable minute: back to the start


@pytest.mark.parametrize("bad", [{"initial_s": 0}, {"initial_s": 2, "max_s": 1}, {"poll_s": 0}])
def test_backoff_config_rejects_bad_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartConfig(**bad)


def test_backoff_config_from_env_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_RESTART_MAX", "soon")
    with pytest.raises(ValueError, match="EMBER_RESTART_MAX"):
        RestartConfig.from_env()


class Sleeper:
    """A real child process (``sleep``) that can be restarted."""

    def __init__(self) -> None:
        self.starts = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        self.proc.wait()
        self.proc = self._start()


def test_a_killed_child_is_restarted() -> None:
    asyncio.run(killed_child_restarted())


async def killed_child_restarted() -> None:
    child = Sleeper()
    spawner = SpawnThread("test-spawn")
    task = asyncio.create_task(
        supervise(ThreadRestarted("sleeper", child, spawner), RestartConfig(initial_s=0.05, poll_s=0.01))
    )
    try:
        first = child.proc.pid
        os.kill(first, signal.SIGKILL)
        for _ in range(500):
            if child.starts == 2 and child.alive():
                break
            await asyncio.sleep(0.01)
        assert child.starts == 2 and child.alive() and child.proc.pid != first
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        child.proc.kill()
        child.proc.wait()
        spawner.close()
