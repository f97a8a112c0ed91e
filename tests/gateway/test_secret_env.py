"""``ember serve`` keeps no secret in ``/proc/<pid>/environ`` (issue 10): handler code runs with
the same uid, and its Landlock sandbox confines reads below EMBER_HOME only, so it could read
the admin key from the gateway's initial environment or from the pool daemon's, which
inherited it. Checked from this (unsandboxed) process: no process of the tree shows it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.spawn import ServeProcess

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-that-must-not-leak-0123456789"


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc/*/stat ppid fields)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return tree


def test_no_process_of_ember_serve_shows_the_admin_key(tmp_path: Path) -> None:
    proc = ServeProcess(tmp_path / "home", env={"EMBER_API_KEY": ADMIN_KEY, "EMBER_PREWARM": "1"})
    try:
        tree = process_tree(proc.proc.pid)
        assert len(tree) >= 3  # ember serve, redis-server, the pool (and the pre-warmed worker)
        for pid in tree:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue  # gone, or unreadable: either way it shows nothing
            assert ADMIN_KEY.encode() not in environ, (pid, Path(f"/proc/{pid}/cmdline").read_bytes())
        with httpx.Client(base_url=proc.url, timeout=30) as http:  # the key still works
            assert http.get("/v1/functions").status_code == 401
            headers = {"authorization": f"Bearer {ADMIN_KEY}"}
            assert http.get("/v1/functions", headers=headers).status_code == 200
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
