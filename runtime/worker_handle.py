"""One worker process as the node agent sees it: its URL, its credential, how to stop it.

The agent speaks to a worker over ``/_ember/*`` (bodies are :mod:`runtime.messages` JSON sent
by :mod:`runtime.worker_client`, each request carries the worker's own credential,
:mod:`runtime.worker_guard`), or sends its assign over the worker's control line
(:mod:`runtime.control_line`) when the agent spawned it with one, and ends
it with SIGTERM, which makes the worker drain and release its pool session; SIGKILL follows
when the drain takes longer than the agent allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import socket
from dataclasses import dataclass, field
from pathlib import Path

from runtime.control_line import Caller
from runtime.messages import AssignMessage
from runtime.worker_guard import TOKEN_HEADER

JSON_HEADERS = {"content-type": "application/json"}  # the agent's messages are runtime.messages JSON


@dataclass
class WorkerHandle:
    """A worker process the agent started: pre-warmed (``device`` empty) or an instance."""

    proc: asyncio.subprocess.Process
    url: str
    log_path: Path
    token: str
    device: str = ""  # the pool device its instance runs on ("" while pre-warmed)
    threads: int | None = None  # intra-op threads the agent last gave its instance (None: none yet)
    assigned: AssignMessage | None = None  # what made it an instance (a standby is prepared from it)
    # The agent's end of the worker's line to the token scheduler (runtime.mesh.grant_server).
    mesh_sock: socket.socket | None = field(default=None, repr=False)
    mesh_page: mmap.mmap | None = field(default=None, repr=False)  # its requests (read-only here)
    # The agent's end of the worker's control line (runtime.control_line): its assign goes there.
    control: Caller | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        """Whether the process has not exited (as far as the event loop has seen)."""
        return self.proc.returncode is None

    @property
    def headers(self) -> dict[str, str]:
        """What every ``/_ember/*`` request to the worker carries."""
        return {TOKEN_HEADER: self.token, **JSON_HEADERS}

    async def terminate(self, drain_timeout_s: float) -> None:
        """SIGTERM (the worker drains), SIGKILL after ``drain_timeout_s``; returns once reaped."""
        try:
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.terminate()
                try:
                    await asyncio.wait_for(self.proc.wait(), drain_timeout_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.kill()
                    await self.proc.wait()
        finally:  # also when cancelled while it drains (the agent closing)
            self.close_lines()

    def close_lines(self) -> None:
        """Close the agent's ends of the worker's token-scheduler line, state page and control
        line (idempotent; detach it from its device's grants first)."""
        if self.mesh_sock is not None:
            self.mesh_sock.close()
        if self.control is not None:
            self.control.close()
        if self.mesh_page is not None:
            self.mesh_page.close()

    def kill(self) -> None:
        """SIGKILL, no drain (its pool session is already gone); reap with ``proc.wait()``."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
