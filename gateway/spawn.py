"""Start ``ember serve``, ``ember gateway`` or ``ember extender`` as a child process and wait
until it serves (for tools, tests, benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ServeError(RuntimeError):
    """``ember serve`` did not become ready."""


class _Child:
    """A child process with its log file: what both launchers share."""

    proc: subprocess.Popen[Any]
    _log: Any

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (SIGKILL after ``timeout``); returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


class ServeProcess(_Child):
    """``python -m gateway.cli VERB --port 0`` (``serve``, or ``gateway`` for cluster mode) with
    its own ``EMBER_HOME``; ``url`` once ready."""

    def __init__(
        self,
        home: Path,
        env: Mapping[str, str] | None = None,
        args: tuple[str, ...] = (),
        timeout: float = 180.0,
        verb: str = "serve",
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``prefix``: a command that runs the server as its argument (say ``unshare``), which must
        exec it, so that ``proc`` is the server itself."""
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = self.home / "serve.log"
        full_env = dict(os.environ, EMBER_HOME=str(self.home), **(env or {}))
        full_env.pop("EMBER_URL", None)
        # 0600 like everything `ember serve` writes under EMBER_HOME (its log may quote secrets).
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._log = open(fd, "ab")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "gateway.cli", verb, "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            cwd=Path(__file__).resolve().parents[1],
        )
        line = self._read_ready(timeout)
        if not line:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise ServeError(f"ember {verb} did not become ready:\n{tail}")
        self.ready: dict[str, Any] = json.loads(line)
        self.url: str = self.ready["url"]
        self.api_key: str | None = self.ready.get("api_key")

    def _read_ready(self, timeout: float) -> bytes:
        return _read_line(self.proc, timeout)

    @property
    def pool_socket(self) -> str:
        return str(self.home / "run" / "pool-cpu.sock")


class ExtenderProcess(_Child):
    """``python -m gateway.cli extender --port 0 --redis URL``; ``url`` (with the prefix) once
    ready. Its decision log (stderr) goes to ``log_path``."""

    def __init__(
        self,
        redis_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        args: tuple[str, ...] = (),
        timeout: float = 60.0,
    ) -> None:
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        full_env = dict(os.environ, **(env or {}))
        full_env.pop("EMBER_REDIS_PASSWORD", None)  # the URL given is complete
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "extender", "--port", "0", "--redis", redis_url, *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            cwd=Path(__file__).resolve().parents[1],
        )
        line = _read_line(self.proc, timeout)
        if not line:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise ServeError(f"ember extender did not become ready:\n{tail}")
        self.ready: dict[str, Any] = json.loads(line)
        self.url: str = self.ready["url"]

    def decisions(self) -> list[dict[str, Any]]:
        """The decision log so far, one JSON object per line (other lines skipped)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith('{"event":"extender.'):
                out.append(json.loads(line))
        return out

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (SIGKILL after ``timeout``); returns the exit status."""
        return super().stop(timeout)


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """The child's first stdout line, or b"" if none comes within ``timeout``."""
    assert proc.stdout is not None
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return out[0] if out else b""
