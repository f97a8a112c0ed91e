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


ROUTES_PROBE = """
import inspect, threading
import uvloop
from runtime.function_sandbox import FunctionSandbox
from runtime.rehearsal import rehearse
from runtime.worker import build_app
from runtime.worker_state import WorkerState

state = WorkerState(sandbox=FunctionSandbox(None))
app = build_app(state)

async def post(path):
    sent = []
    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}
    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-length", b"2")], "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0)}
    await app(scope, receive, send)
    return sent[0]["status"]

async def main():
    await rehearse(app)
    calls = []
    real = inspect.getsourcelines
    inspect.getsourcelines = lambda obj: (calls.append(obj), real(obj))[1]
    paths = ("/_ember/assign", "/_ember/standby", "/v1/chat/completions", "/invoke")
    statuses = [await post(p) for p in paths]
    return calls, statuses

calls, statuses = uvloop.run(main())
# The endpoints' first calls happened in the rehearsal: the first assign reads no source file.
assert calls == [], [getattr(c, "__name__", c) for c in calls]
assert all(400 <= s < 500 for s in statuses), statuses
# Refused, the rehearsal left nothing behind: no function, no assignment under way, no thread.
assert state.assignment is None and state.standby is None and not state.assigning
assert threading.active_count() == 1, threading.enumerate()
print("ok")
"""


def test_rehearsal_makes_each_routes_first_call_before_the_worker_is_ready() -> None:
    out = subprocess.run(
        [sys.executable, "-c", ROUTES_PROBE], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
