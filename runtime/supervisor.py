"""Supervision: notice a dead child process and restart it with exponential backoff.

``ember serve`` owns long-lived children whose death must heal without an operator: the
embedded ``redis-server`` and one pool daemon per device. :func:`supervise` polls a child's
liveness, runs its ``on_death`` hook (fail what depended on it), then restarts it after a
delay that doubles from ``initial_s`` to ``max_s`` with every death or failed attempt, and
falls back to ``initial_s`` once the child has stayed up for ``stable_s`` (a crash loop
backs off; a rare crash heals in ``initial_s``).

:class:`SpawnThread` is the one long-lived thread children are restarted from:
``runtime.process.die_with_parent`` ties a child to the *thread* that forked it, so a restart
must not fork from a short-lived worker thread (``asyncio.to_thread``), nor block the event
loop while the child starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

log = logging.getLogger("ember.supervisor")

_T = TypeVar("_T")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


@dataclass(frozen=True, slots=True)
class RestartConfig:
    """Restart delays (seconds) and how often liveness is polled."""

    initial_s: float = 0.1
    max_s: float = 5.0
    stable_s: float = 60.0  # up this long: the next death restarts after initial_s again
    poll_s: float = 0.05  # a death is noticed within this (a poll is one waitpid)

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("restart backoff needs 0 < initial_s <= max_s")
        if self.stable_s <= 0 or self.poll_s <= 0:
            raise ValueError("stable_s and poll_s must be > 0")

    @classmethod
    def from_env(cls) -> RestartConfig:
        """``EMBER_RESTART_INITIAL`` and ``EMBER_RESTART_MAX`` (seconds), else the defaults."""
        return cls(
            initial_s=_env_seconds("EMBER_RESTART_INITIAL", 0.1),
            max_s=_env_seconds("EMBER_RESTART_MAX", 5.0),
        )


class Backoff:
    """The delay before each restart attempt (see module docstring)."""

    def __init__(self, config: RestartConfig) -> None:
        self.config = config
        self._next = config.initial_s
        self._up_since: float | None = None

    def up(self, now: float) -> None:
        """The child is (again) running since ``now`` (monotonic seconds)."""
        self._up_since = now

    def next_delay(self, now: float) -> float:
        """The delay before the next attempt; each call doubles the one after, up to ``max_s``."""
        if self._up_since is not None and now - self._up_since >= self.config.stable_s:
            self._next = self.config.initial_s
        self._up_since = None
        delay = self._next
        self._next = min(self._next * 2, self.config.max_s)
        return delay


class Child(Protocol):
    """What :func:`supervise` needs of a supervised process."""

    name: str

    def alive(self) -> bool: ...

    async def on_death(self) -> None: ...

    async def restart(self) -> None: ...


async def supervise(child: Child, config: RestartConfig) -> None:
    """Keep ``child`` running until cancelled (errors are logged, never fatal)."""
    backoff = Backoff(config)
    backoff.up(time.monotonic())
    while True:
        await asyncio.sleep(config.poll_s)
        if child.alive():
            continue
        log.warning("%s died; restarting it", child.name)
        try:
            await child.on_death()
        except Exception:  # what depended on it is best effort: the restart matters more
            log.exception("%s: cleaning up after its death failed", child.name)
        while True:
            await asyncio.sleep(backoff.next_delay(time.monotonic()))
            try:
                await child.restart()
            except Exception as exc:
                log.warning("%s: restart failed (%s); trying again", child.name, exc)
                continue
            backoff.up(time.monotonic())
            log.warning("%s restarted", child.name)
            break


class SpawnThread:
    """One long-lived thread to (re)start children from (see module docstring)."""

    def __init__(self, name: str) -> None:
        # An idle executor thread waits for work until shutdown: it lives as long as we need.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the thread and wait for it without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def close(self) -> None:
        """End the thread (after the children it started are stopped: they die with it)."""
        self._executor.shutdown(wait=True)


@dataclass
class ThreadRestarted:
    """A :class:`Child` over a process object with blocking ``alive()`` and ``restart()``."""

    name: str
    process: Restartable
    spawner: SpawnThread

    def alive(self) -> bool:
        return self.process.alive()

    async def on_death(self) -> None:
        return None

    async def restart(self) -> None:
        await self.spawner.run(self.process.restart)


class Restartable(Protocol):
    """A process object that can say whether it runs and restart itself (blocking)."""

    def alive(self) -> bool: ...

    def restart(self) -> None: ...
