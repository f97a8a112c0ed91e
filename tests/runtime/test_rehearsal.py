"""A pre-warmed worker pays the request path's lazy imports before it is ready (runtime.rehearsal)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import asyncio, sys, threading
import uvloop
from runtime.rehearsal import rehearse
assert "anyio._backends._asyncio" not in sys.modules, "already imported: the probe proves nothing"
seconds = uvloop.run(rehearse())
# What a first streamed response would otherwise import on the cold path:
assert "anyio._backends._asyncio" in sys.modules
# No thread: one started before the function's sandbox layer would escape it.
assert threading.active_count() == 1, threading.enumerate()
print(seconds)
"""


def test_rehearsal_imports_the_streaming_path_and_starts_no_thread() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 0
