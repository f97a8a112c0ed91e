"""Instance workers that outlived their pool daemon, kept to start their function again.

When a device's pool daemon dies, its instances end: their pool sessions, KV blocks and the
arena their weights were mapped from are gone. Their worker processes need not go with them.
A worker the agent started with ``--survive-pool-loss`` ends its instance itself (its requests
in the engine fail with one error each; later ones are answered 503 never-ran, and the
gateway routes them again: :meth:`runtime.worker_state.WorkerState.release`) and stays up, still
confined to its function, with torch imported and its handler module loaded. The agent keeps
it here, and the function's next start on that device, once the pool is back, assigns it again
instead of a pre-warmed worker: after a pool restart every instance would otherwise need a
process start at once (seconds each on a small, busy node, one after another), while the
pre-warmed pool holds only ``prewarm`` of them.

Not where instances take turns on the device (token scheduling, :mod:`runtime.mesh`): the
worker's line to the token scheduler may still carry the ended instance's messages, which the
next instance would take for its own; those workers are killed as before. A handler can keep
state in its process beyond its module (``os.environ``, other modules, threads it started), as
in a reused warm container; a worker that still maps the dead pool's memory once its instance
is collected (a reference the handler kept) exits instead of waiting.

A survivor is reused only for the very spec and model it served (a redeployed function's
survivor ends), at most once, and ends after ``survivor_keep_s``, when its function is
deleted or redeployed, or when the agent closes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from runtime.agent_config import AgentConfig
from runtime.messages import AssignMessage
from runtime.standby_pool import function_name
from runtime.worker_handle import WorkerHandle

log = logging.getLogger("ember.agent")


@dataclass
class Survivor:
    """A worker whose instance ended with its pool."""

    worker: WorkerHandle
    assigned: AssignMessage  # what made it the instance that ended
    device: str
    since: float  # monotonic seconds its pool died


class Survivors:
    """The survivors of one agent, by function (see the module docstring)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._by_function: dict[str, list[Survivor]] = {}

    @property
    def enabled(self) -> bool:
        """Whether workers are kept (else the agent kills an instance's worker with its pool)."""
        return self.config.survivor_keep_s > 0

    def pids(self) -> list[int]:
        return [s.worker.pid for group in self._by_function.values() for s in group]

    def report(self, device: str) -> dict[str, int]:
        """The device report's view: how many survivors wait on ``device``."""
        waiting = sum(s.device == device for group in self._by_function.values() for s in group)
        return {"survivor_workers": waiting}

    def add(self, worker: WorkerHandle, device: str) -> None:
        """Keep ``worker``, whose instance on ``device`` ended with its pool."""
        assert worker.assigned is not None, "only an instance's worker survives its pool"
        name = function_name(worker.assigned.spec)
        self._by_function.setdefault(name, []).append(
            Survivor(worker, worker.assigned, device, time.monotonic())
        )
        log.info("worker %d of %s waits for its pool to come back", worker.pid, name)

    async def take(self, spec: dict[str, Any], model_dir: str, device: str) -> WorkerHandle | None:
        """A survivor that served this very ``spec`` and model on ``device`` (None: none); the
        function's survivors for another spec or model end (it was redeployed)."""
        if not self._by_function:  # (the common case: no pool died)
            return None
        name = function_name(spec)
        found: Survivor | None = None
        ended: list[Survivor] = []
        for s in self._by_function.pop(name, []):  # (taken whole before anything is awaited)
            same = s.assigned.spec == spec and s.assigned.model_dir == model_dir
            if not s.worker.running or not same:
                ended.append(s)
            elif found is None and s.device == device:
                found = s
            else:
                self._by_function.setdefault(name, []).append(s)
        for s in ended:
            await s.worker.terminate(self.config.drain_timeout_s)
        return None if found is None else found.worker

    async def expire(self, now: float | None = None) -> None:
        """End the survivors kept longer than ``survivor_keep_s`` at ``now`` (monotonic seconds;
        default the present), and forget those whose process exited."""
        now = time.monotonic() if now is None else now
        ended: list[tuple[str, Survivor]] = []
        for name, group in list(self._by_function.items()):
            kept = [s for s in group if s.worker.running and now - s.since <= self.config.survivor_keep_s]
            ended += [(name, s) for s in group if s not in kept]
            if kept:
                self._by_function[name] = kept
            else:
                del self._by_function[name]
        for name, s in ended:
            if s.worker.running:
                log.info("worker %d of %s was not needed again: it ends", s.worker.pid, name)
            await s.worker.terminate(self.config.drain_timeout_s)

    async def end(self, name: str) -> None:
        """End ``name``'s survivors (the function was deleted or redeployed)."""
        for s in self._by_function.pop(name, []):
            await s.worker.terminate(self.config.drain_timeout_s)

    async def close(self) -> None:
        for name in list(self._by_function):
            await self.end(name)
