"""The agent's handle on a worker process: its lines to the token scheduler are closed on
every way out (a leaked socket is a ResourceWarning, an error under CI's warning filters)."""

from __future__ import annotations

import asyncio
import mmap
import socket
import sys
import time
from pathlib import Path

import pytest

from runtime.agent import NodeAgent, _Start
from runtime.messages import AssignMessage
from runtime.worker_handle import WorkerHandle
from tests.runtime.test_agent_workers import agent_config, spec

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
)


def test_a_terminate_cancelled_while_the_worker_drains_still_closes_its_lines(tmp_path: Path) -> None:
    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", IGNORES_SIGTERM, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        await proc.stdout.readline()  # SIGTERM is ignored from here on
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.close()
        page = mmap.mmap(-1, 4096)
        url, log = "http://127.0.0.1:1", tmp_path / "w.log"
        worker = WorkerHandle(proc, url, log, "t", mesh_sock=ours, mesh_page=page)
        ending = asyncio.create_task(worker.terminate(drain_timeout_s=30.0))
        await asyncio.sleep(0.2)
        ending.cancel()  # the agent closing while the worker drains
        await asyncio.gather(ending, return_exceptions=True)
        assert ours.fileno() == -1 and page.closed
        worker.kill()
        await proc.wait()
        worker.close_lines()  # idempotent

    asyncio.run(scenario())


# A worker that accepts the agent's connections and never answers: an assign in progress.
NEVER_ANSWERS = """
import socket, time
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
held = []
while True:
    held.append(server.accept()[0])
"""


async def silent_worker(tmp_path: Path) -> tuple[WorkerHandle, socket.socket, mmap.mmap]:
    """A live worker process (it never answers) with the agent's ends of its lines."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", NEVER_ANSWERS, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    port = int(await proc.stdout.readline())
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()
    page = mmap.mmap(-1, 4096)
    worker = WorkerHandle(
        proc, f"http://127.0.0.1:{port}", tmp_path / "w.log", "t", mesh_sock=ours, mesh_page=page
    )
    return worker, ours, page


async def end(worker: WorkerHandle, agent: NodeAgent) -> None:
    """Whatever the test saw: the worker gone, its lines closed, the agent closed."""
    worker.kill()
    await worker.proc.wait()
    worker.close_lines()
    await agent.close()


def assign_message(instance_id: str) -> AssignMessage:
    document = spec("f", {"source": "/m/tiny.gguf"})
    return AssignMessage(instance_id, document, "/models/m", "/run/pool.sock", "ticket", time.time() + 60)


def test_an_assign_cancelled_while_the_worker_takes_it_ends_the_worker_and_its_lines(tmp_path: Path) -> None:
    """The scheduler closing cancels its launches: a worker half assigned is neither an instance
    nor pre-warmed any more, so nobody else would end it or close its lines."""

    async def scenario() -> None:
        agent = NodeAgent(agent_config(tmp_path / "home", prewarm=0, drain_timeout_s=5.0))
        worker, ours, page = await silent_worker(tmp_path)
        try:
            assigning = asyncio.create_task(agent._assign(worker, assign_message("1")))
            await asyncio.sleep(0.5)  # the request is sent; the worker "loads"
            assigning.cancel()
            with pytest.raises(asyncio.CancelledError):
                await assigning
            assert worker.proc.returncode is not None
            assert ours.fileno() == -1 and page.closed
        finally:
            await end(worker, agent)

    asyncio.run(scenario())


def test_an_assigned_worker_that_cannot_become_the_instance_is_ended(tmp_path: Path) -> None:
    """After the assign, the instance's log moves under its function (here the worker's log is
    gone): a launch that fails there must not leave the worker running, unknown to the agent."""

    async def scenario() -> None:
        agent = NodeAgent(agent_config(tmp_path / "home", prewarm=0, drain_timeout_s=5.0))
        worker, ours, page = await silent_worker(tmp_path)  # its log file was never written
        message = assign_message("2")
        start = _Start("2", message.spec, {"dir": "/models/m"}, "cpu", message.deadline, None, False)
        try:
            with pytest.raises(FileNotFoundError):
                await agent._install(start, worker, message)
            assert not agent.owns("2")
            assert worker.proc.returncode is not None
            assert ours.fileno() == -1 and page.closed
        finally:
            await end(worker, agent)

    asyncio.run(scenario())
