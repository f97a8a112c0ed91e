"""What a worker process holds (:class:`WorkerState`): its templates, its function once
assigned (or prepared as a standby), the requests held for an assign, its sandbox and its line
to the agent's token scheduler; and what it does when its pool daemon dies
(:meth:`WorkerState.pool_lost`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_pool.errors import PoolError
from runtime.assignment import Assignment, Standby, pool_lost
from runtime.core_spread import own_cores
from runtime.early_requests import EarlyRequests
from runtime.function_sandbox import FunctionSandbox
from runtime.instance import ModelTemplate, load_template, warm_up
from runtime.messages import AssignMessage

log = logging.getLogger("ember.worker")
# After an instance ended with its pool, collect its engine's reference cycles this much later
# (s): the requests it failed have answered by then.
RELEASE_GC_S = 0.2
POOL_PROBE_S = 0.5  # how long a pool's socket is watched to tell a dying daemon (s)
# The CPU pool's arena and KV memory files (gpu_pool.arena) as /proc/self/maps names them.
DEAD_POOL_MAPPINGS = re.compile(r"/memfd:ember-(pool-arena|kv-)")


@dataclass
class WorkerState:
    """Everything a worker holds: preloaded templates and, once assigned, its function."""

    templates: dict[str, ModelTemplate] = field(default_factory=dict)
    mapped: dict[str, Any] = field(default_factory=dict)  # pool socket -> gpu_pool.client.MappedArena
    assignment: Assignment | None = None
    standby: Standby | None = None  # prepared for one function (runtime.assignment), until assigned
    activating: Standby | None = None  # the standby being activated, while it is
    assigning: bool = False  # an assign or a standby is being prepared
    early: EarlyRequests = field(default_factory=EarlyRequests)  # requests held for the assign
    sandbox: FunctionSandbox = field(default_factory=lambda: FunctionSandbox(None))
    # This worker's end of its socketpair with the agent's token scheduler (runtime.mesh).
    mesh_sock: socket.socket | None = None
    mesh_page: Any = None  # mmap.mmap of the state page it publishes (runtime.mesh.state_page)
    # When its pool dies, end the instance but not the process (the agent starts the function
    # on it again: :meth:`pool_lost`); else drain and exit.
    survive_pool_loss: bool = False
    released: str | None = None  # the instance ended by its pool's death, while none followed
    lost_while_assigning: bool = False  # the pool died during the current assign or preparation
    exiting: bool = False  # its pool dropped its session: it drains and exits
    loop: asyncio.AbstractEventLoop | None = None  # the event loop serving (set by serve)
    # The cores its main thread may use, as it started (runtime.core_spread: an activation pins it).
    cores: frozenset[int] | None = field(default_factory=own_cores)

    def schedule_tokens(self, message: AssignMessage) -> None:
        """Let the agent's token scheduler grant this instance's iterations, when it asks to."""
        if not message.token_scheduling or self.mesh_sock is None or self.assignment is None:
            return
        from runtime.mesh.gate import Gate
        from runtime.mesh.slo import slo_of
        from runtime.mesh.state_page import StatePage
        from runtime.mesh.time_table import TimeTable

        page = StatePage(memoryview(self.mesh_page)) if self.mesh_page is not None else None
        binding = self.assignment.binding
        raw = binding.template.profile.get("time_table")
        try:
            table = TimeTable.from_json(raw) if raw is not None else None
        except ValueError:
            table = None  # no calibration; the agent reads the same profile and says so
        binding.engine.schedule_with(Gate(self.mesh_sock, page), slo_of(message.spec), table)

    def template(self, model_dir: str, warm: bool = False) -> ModelTemplate:
        """The template of ``model_dir`` (loaded once); ``warm`` also runs :func:`warm_up` on it."""
        if model_dir not in self.templates:
            template = load_template(Path(model_dir))
            if warm:
                warm_up(template)
            self.templates[model_dir] = template
        return self.templates[model_dir]

    def pool_lost(self) -> None:
        """The pool daemon of this worker's session died (called from the session's watch
        thread). A worker that survives it (``survive_pool_loss``: the agent's) ends its
        instance or standby on the event loop (:meth:`release`) and stays up, confined to its
        function, for the agent to start that function on it again once the pool is back: no
        process start, import or sandbox on that path. Any other drains and exits."""
        if not self.survive_pool_loss or self.loop is None:
            pool_lost()
            return
        holder = self.assignment or self.standby or self.activating
        self.loop.call_soon_threadsafe(self.release)  # the session is gone either way
        # A daemon that still serves dropped this one session and did not die: the agent knows
        # of no death and would never start the function here again, so the worker exits as it
        # always did (the agent forgets the instance and starts another).
        if holder is not None and holder.client.daemon_answers(POOL_PROBE_S):
            log.error("the pool daemon dropped this worker's session (it still serves): exiting")
            self.exiting = True
            pool_lost()

    def release(self) -> None:
        """End the instance (or standby) whose pool died. Its requests in the engine fail with
        one error each (their KV is gone); a handler call in flight finishes. Requests for it
        that come later are answered 503 never-ran, which the gateway routes again."""
        if self.standby is not None:
            self.standby.client.close()  # its blocks went with the pool: nothing to give back
            self.standby = None
        a = self.assignment
        if a is None:
            if self.assigning:  # the assign fails once it returns (runtime.worker)
                self.lost_while_assigning = True
            return
        log.error("the pool daemon went away: instance %s ends, the worker waits", a.instance_id)
        self.assignment, self.released = None, a.instance_id
        a.driver.cancel()
        engine = a.binding.engine
        if engine.gate is not None:  # the line stays: the next instance schedules on it
            engine.gate.detach()
            engine.gate = None
        engine.end(f"the pool daemon went away: instance {a.instance_id} ended")
        a.client.close()
        # The dead arena's mapping alone keeps its memory alive: the next session maps the new one.
        self.mapped.pop(a.client.socket_path, None)
        # Its views go with the engine, once the requests that hold it have ended (a moment):
        # the dead arena's memory is then free for the restarted pool's.
        if self.loop is not None:
            self.loop.call_later(RELEASE_GC_S, self._check_released)

    def _check_released(self) -> None:
        """After a release: collect the ended instance's engine, and exit (drain) if the dead
        pool's memory is still mapped all the same, say through a reference the handler kept:
        a worker reused after each pool death would hold one more dead arena every time."""
        gc.collect()
        if self.assignment is not None or self.assigning or self.exiting:  # (assigned again)
            return
        with open("/proc/self/maps") as maps:
            held = [line for line in maps if DEAD_POOL_MAPPINGS.search(line)]
        if held:
            log.error("the dead pool's memory is still mapped (%d mappings): exiting", len(held))
            pool_lost()

    def close(self) -> None:
        if self.standby is not None:
            self.standby.close()
            self.standby = None
        a = self.assignment
        if a is not None:
            a.driver.cancel()
            with contextlib.suppress(OSError, PoolError):  # its KV blocks went with a dead pool
                a.binding.engine.close()
            a.client.close()
            self.assignment = None
