"""Start a pool daemon as a child process and wait until it serves (for tools and tests).

:class:`PoolProcess` makes a fresh admin token for every daemon and writes it to the child's
stdin (``--admin-token-file -``): it never appears in argv (world-readable in ``/proc``) nor
in the child's environment. The parent keeps it as :attr:`PoolProcess.admin_token`.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from gpu_pool.errors import PoolError


class PoolProcess:
    """``python -m gpu_pool`` in its own process; ``ready`` is its readiness announcement."""

    def __init__(
        self,
        socket_path: str,
        arena: str | int,
        device: str = "cpu",
        extra_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        log_path: str | None = None,
        store_roots: Sequence[str | os.PathLike[str]] = (),
        session_kv_quota: int | None = None,
        launcher: Sequence[str] = (),
    ) -> None:
        """Start the daemon and wait for its readiness line. ``log_path``: where its stderr
        goes (append); without it stderr is a pipe, which suits short-lived daemons only (a
        long-lived one would block once an unread pipe fills). ``store_roots``: the model
        store directories it may load tensors from (``--store``; without any, and without
        ``EMBER_POOL_STORE`` in its environment, it refuses every acquire of tensors).
        ``session_kv_quota``: KV bytes a session without a ticket may hold; None (the default,
        until workers carry tickets from :meth:`gpu_pool.client.PoolClient.grant`) is
        unlimited. ``EMBER_POOL_SESSION_KV_QUOTA`` in ``env`` takes precedence. ``launcher``: a
        command prefix that execs the daemon (``unshare --net --``: a simulated node's own
        network namespace); ``proc`` is then the daemon once the prefix has exec'd it."""
        self.socket_path = str(socket_path)
        self.admin_token = secrets.token_urlsafe(32)
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115  (closed in stop())
        args = [
            *launcher,
            sys.executable,
            "-m",
            "gpu_pool",
            "--device",
            device,
            "--arena",
            str(arena),
            "--socket",
            self.socket_path,
        ]
        for root in store_roots:
            args += ["--store", os.fspath(root)]
        args += ["--admin-token-file", "-"]
        child_env = dict(os.environ, **(env or {}))
        child_env.pop("EMBER_POOL_ADMIN_TOKEN", None)
        child_env.setdefault(
            "EMBER_POOL_SESSION_KV_QUOTA", "unlimited" if session_kv_quota is None else str(session_kv_quota)
        )
        self.proc = subprocess.Popen(
            [*args, *extra_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.PIPE,
            text=True,
            env=child_env,
            preexec_fn=preexec_fn,  # noqa: PLW1509  (callers pass async-signal-safe calls only)
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(self.admin_token + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; its stderr says why below
        line = self.proc.stdout.readline()
        if not line:
            if self.proc.stderr is not None:
                err = self.proc.stderr.read()
            else:
                self.proc.wait(10)
                err = open(log_path or "", errors="replace").read()[-3000:]  # noqa: SIM115
            self.stop()
            raise PoolError(f"pool daemon failed to start: {err.strip()}")
        self.ready: dict[str, Any] = json.loads(line)
        if self.ready.get("event") != "ready":
            self.stop()
            raise PoolError(f"pool daemon announced {line.strip()!r} instead of readiness")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s) and close the pipes."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        if self._log is not None:
            self._log.close()


@contextmanager
def running_pool(socket_path: str, arena: str | int, **kwargs: Any) -> Iterator[PoolProcess]:
    """A :class:`PoolProcess` stopped when the block ends."""
    pool = PoolProcess(socket_path, arena, **kwargs)
    try:
        yield pool
    finally:
        pool.stop()
