"""Durable record writes: a deploy, a delete or a tenant key change is acknowledged only once
Redis cannot lose it.

Redis replies to a write before it is on disk. What survives a crash of ``redis-server``
(SIGKILL, OOM kill) is what it wrote to its append-only file before dying, and with
``appendfsync everysec`` Redis 6.2-8 hold that write back for up to 2 s while the previous
second's fsync still runs (a busy disk), replying OK meanwhile: an acknowledged deploy was
lost that way. The per-request writes (slot leases, instance states) may go that way: they
are rebuilt from live processes. Records may not, so their writes go through
:class:`RecordWriter`, one of two ways:

- **embedded Redis** (``sync_files`` given): the server runs ``appendfsync no``, which never
  holds a write back (every reply follows the ``write()`` of its command to the file, so a
  killed server loses nothing), and after a record write ``sync_files`` fsyncs the
  append-only file and the server is asked whether that write succeeded (``INFO
  persistence``: with ``appendfsync no``, a write that failed on a full disk is still
  answered OK), so the record also survives a power loss. ``ember serve`` fsyncs the file
  every second besides (:meth:`scheduler.redis_server.EmbeddedRedis.keep_synced`);
- **a Redis of its own** (cluster mode): ``WAITAOF 1 0`` on the connection that wrote, which
  returns once the server's fsync covers the write (Redis 7.2 and later, ``appendonly yes``,
  an ``appendfsync`` other than ``no``). A server that cannot promise it (older, no
  append-only file, ``appendfsync no``, an ACL without WAITAOF) is said so once in the log,
  and asked again every :data:`RECHECK_S`; until then records are as durable as its
  configuration makes them.

A write that was stored but not confirmed raises :class:`~scheduler.errors.StoredNotDurable`
(503): the caller finishes what the change implies and tells the client, who may repeat it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script

from scheduler.errors import StoredNotDurable

log = logging.getLogger("ember.scheduler")

DEFAULT_WAITAOF_TIMEOUT_MS = 3000  # an everysec fsync plus Redis's 2 s hold-back on a busy disk
RECHECK_S = 60.0  # how long a server that cannot confirm writes is taken at its word
HIDDEN_POLICY_TIMEOUTS = 2  # WAITAOF timeouts in a row that make a CONFIG-less server "cannot"


class RecordWriter:
    """Runs the Lua scripts that change records; returns once the change is durable."""

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
        # WAITAOF is sent while this holds; a server that cannot honour it turns it off until
        # _recheck_at (monotonic s), when its configuration is read again.
        self.waitaof = sync_files is None
        self._policy_read = False
        self._recheck_at = 0.0
        self._warned = False
        self._policy_hidden = False  # CONFIG GET appendfsync was refused
        self._timeouts = 0  # WAITAOF timeouts in a row

    def run(self, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """``script``'s reply, once its write is durable. Redis errors propagate as redis-py
        raises them (the caller maps them); :class:`StoredNotDurable` when the write happened
        but was not confirmed on disk."""
        if self._sync_files is not None:
            reply = script(keys=keys, args=args)
            self._sync_embedded()
            return reply
        if not self.waitaof and time.monotonic() >= self._recheck_at:
            self.waitaof, self._policy_read = True, False
        if self.waitaof and not self._policy_read:
            self._policy_read = True
            self._read_policy()
        if not self.waitaof:
            return script(keys=keys, args=args)
        # WAITAOF waits for the writes of the connection it runs on: one pipeline, one connection.
        pipe = self._client.pipeline(transaction=False)
        script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAITAOF", 1, 0, self._timeout_ms)
        reply, waited = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(waited, redis.exceptions.ResponseError) and _cannot_wait(waited):
            self._give_up(f"WAITAOF: {waited}")
            return reply
        if isinstance(waited, Exception):
            raise waited
        if int(waited[0]) < 1:
            self._timeouts += 1
            if not self._read_policy():  # appendfsync set to no meanwhile: never confirmed
                return reply
            if self._policy_hidden and self._timeouts >= HIDDEN_POLICY_TIMEOUTS:
                # CONFIG is hidden from us, so a server that never fsyncs looks like a slow
                # disk: after that many timeouts in a row, take it for one that cannot confirm.
                self._give_up(f"WAITAOF timed out {self._timeouts} times and CONFIG is not readable")
            raise StoredNotDurable(
                f"the change is stored, but Redis did not confirm it on disk within {self._timeout_ms} ms "
                "(a slow disk?): it may not survive a Redis crash; repeating the request is safe"
            )
        self._timeouts = 0
        return reply

    def _sync_embedded(self) -> None:
        """fsync the embedded server's files, then check that its write of them succeeded."""
        assert self._sync_files is not None
        try:
            self._sync_files()
        except OSError as exc:
            raise StoredNotDurable(
                f"the change is stored, but syncing Redis's append-only file failed ({exc.strerror}): "
                "it may not survive a power loss; repeating the request is safe"
            ) from None
        try:  # the write happened: a lost connection here must not make the caller run it again
            status = self._client.info("persistence").get("aof_last_write_status")
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoredNotDurable(
                f"the change is stored, but Redis went away before confirming it was written ({exc}): "
                "repeating the request is safe"
            ) from None
        if status not in ("ok", b"ok"):
            raise StoredNotDurable(
                "the change is stored in memory, but Redis could not write its append-only file "
                "(a full disk?): it may not survive a Redis restart; repeat the request once "
                "Redis can write again"
            )

    def _read_policy(self) -> bool:
        """Turn WAITAOF off for a server whose ``appendfsync`` is ``no`` (it never fsyncs, so
        it never confirms); returns whether WAITAOF stays on. A server that does not let us
        read its configuration is tried (``_policy_hidden``)."""
        try:
            policy = self._client.config_get("appendfsync").get("appendfsync")
        except redis.exceptions.ResponseError:  # CONFIG renamed or not in the ACL: try WAITAOF
            self._policy_hidden = True
            return self.waitaof
        self._policy_hidden = policy is None
        if policy in ("no", b"no"):
            self._give_up("its appendfsync is no")
        return self.waitaof

    def _give_up(self, why: str) -> None:
        self.waitaof = False
        self._timeouts = 0
        self._recheck_at = time.monotonic() + RECHECK_S
        if not self._warned:
            self._warned = True
            log.warning(
                "Redis cannot confirm writes on disk (%s): deployed functions and tenant keys are "
                "as durable as its configuration makes them; use Redis 7.2 or later with "
                "appendonly yes and appendfsync everysec or always",
                why,
            )


def _cannot_wait(error: redis.exceptions.ResponseError) -> bool:
    """Whether ``error`` says the server cannot run WAITAOF at all (not a failure of this write)."""
    text = str(error).lower()
    return (
        "unknown command" in text
        or "appendonly" in text
        or isinstance(error, redis.exceptions.NoPermissionError)
        or text.startswith("noperm")
    )
