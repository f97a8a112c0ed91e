"""The embedded Redis requires a password (issue 10): its 0700 Unix socket does not keep out
handler code, which runs with the same uid and whose Landlock sandbox confines reads, not
``connect``. Without the password a sandboxed process could rewrite the cluster state (mint
itself a tenant key for any namespace, repoint another function's handler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from runtime.sandbox import abi_version
from scheduler.redis_server import EmbeddedRedis

REPO = Path(__file__).resolve().parents[2]

# A handler's view: confined by the worker sandbox, it connects to the socket it can reach.
CHILD = r"""
import json, socket, sys
from pathlib import Path
from runtime.sandbox import apply

home = Path(sys.argv[1])
seen = {"applied": apply(home).applied}
try:
    seen["password file"] = (home / "redis" / "password").read_text()
except OSError as exc:
    seen["password file"] = type(exc).__name__
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(str(home / "redis" / "redis.sock"))
s.sendall(b"*4\r\n$4\r\nHSET\r\n$17\r\nember:tenant_keys\r\n$1\r\nx\r\n$1\r\ny\r\n")
seen["reply"] = s.recv(200).decode(errors="replace")
print(json.dumps(seen))
"""


@pytest.mark.skipif(abi_version() == 0, reason="this kernel has no Landlock")
def test_handler_code_cannot_use_the_embedded_redis(tmp_path: Path) -> None:
    home = tmp_path / "home"
    server = EmbeddedRedis(home / "redis")
    server.start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(home)],
            cwd=REPO, env=dict(os.environ, TMPDIR=str(tmp_path)), capture_output=True, text=True,
            timeout=60, check=True,
        )  # fmt: skip
        seen = json.loads(out.stdout)
        assert seen["applied"] is True
        assert seen["password file"] == "PermissionError"
        assert seen["reply"].startswith("-NOAUTH"), seen
        client = redis.Redis.from_url(server.url)
        assert client.hget("ember:tenant_keys", "x") is None  # the write was refused
        client.close()
        assert (home / "redis" / "password").stat().st_mode & 0o777 == 0o600
    finally:
        server.stop()


def test_a_restart_keeps_the_password(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        url = server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=server.socket_path).ping()
        server.restart()
        assert url == server.url and redis.Redis.from_url(url).ping()
        assert EmbeddedRedis(tmp_path / "redis").url == url  # a new `ember serve` on the same home
    finally:
        server.stop()
