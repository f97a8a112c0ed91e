"""Durable record writes: a deploy or delete is acknowledged only once Redis cannot lose it.

Redis replies to a write before it is on disk. What survives a crash of ``redis-server``
(SIGKILL, OOM kill) is what it wrote to its append-only file before dying, and with
``appendfsync everysec`` Redis 6.2-8 hold that write back for up to 2 s while the previous
second's fsync still runs (a busy disk), replying OK meanwhile: an acknowledged deploy was
lost that way. The per-request writes (slot leases, instance states) may go that way: they
are rebuilt from live processes. Function records may not, so their writes go through
:class:`RecordWriter`, one of two ways:

- **embedded Redis** (``sync_files`` given): the server runs ``appendfsync no``, which never
  holds a write back (every reply follows the ``write()`` of its command to the file, so a
  killed server loses nothing), and after a record write the caller's ``sync_files`` fsyncs
  the append-only file, so the record also survives a power loss;
- **a Redis of its own** (cluster mode): ``WAITAOF 1 0`` on the connection that wrote, which
  returns once the server's fsync covers the write (Redis 7.2 and later, with
  ``appendonly yes``). An older server, or one without an append-only file, cannot promise
  it: the writer says so once in the log and the records are as durable as its
  ``appendfsync`` policy makes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script

from scheduler.errors import StateUnavailable

log = logging.getLogger("ember.scheduler")

DEFAULT_WAITAOF_TIMEOUT_MS = 3000  # an everysec fsync plus Redis's 2 s hold-back on a busy disk


class RecordWriter:
    """Runs the Lua scripts that change function records; returns once the change is durable."""

    def __init__(
        self,
        client: redis.Redis,
        sync_files: Callable[[], None] | None = None,
        waitaof_timeout_ms: int = DEFAULT_WAITAOF_TIMEOUT_MS,
    ) -> None:
        if not 0 < waitaof_timeout_ms <= 60_000:
            raise ValueError(f"waitaof_timeout_ms must be in (0, 60000], got {waitaof_timeout_ms}")
        self._client: Any = client
        self._sync_files = sync_files
        self._timeout_ms = waitaof_timeout_ms
        # Whether WAITAOF is worth sending: False once the server said it cannot (old or no AOF).
        self.waitaof = sync_files is None

    def run(self, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """``script``'s reply, once its write is durable. Redis errors propagate as redis-py
        raises them (the caller maps them); :class:`StateUnavailable` when the server did not
        confirm the write on disk in time (the write itself happened: retrying is safe)."""
        if not self.waitaof:
            reply = script(keys=keys, args=args)
            if self._sync_files is not None:
                self._sync_files()
            return reply
        # WAITAOF waits for the writes of the connection it runs on: one pipeline, one connection.
        pipe = self._client.pipeline(transaction=False)
        script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAITAOF", 1, 0, self._timeout_ms)
        reply, waited = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(waited, redis.exceptions.ResponseError):
            self._cannot_wait(waited)
            return reply
        if isinstance(waited, Exception):
            raise waited
        if int(waited[0]) < 1:
            raise StateUnavailable(
                f"Redis did not write the change to its append-only file within {self._timeout_ms} ms "
                "(a slow disk?): it is stored but may not survive a Redis crash; retry"
            )
        return reply

    def _cannot_wait(self, error: redis.exceptions.ResponseError) -> None:
        """Stop sending WAITAOF to a server that cannot honour it (logged once)."""
        text = str(error)
        if "unknown command" not in text.lower() and "appendonly" not in text.lower():
            raise error
        self.waitaof = False
        log.warning(
            "Redis cannot confirm writes on disk (WAITAOF: %s): deployed functions are as durable "
            "as its appendfsync policy; use Redis 7.2 or later with appendonly yes",
            text,
        )
