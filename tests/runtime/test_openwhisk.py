"""OpenWhisk's action interface on the worker (issue 11): ``/init`` once, ``/run`` per activation
with its ``__OW_*`` environment and deadline, the end-of-activation markers, serialized
activations, KV released after each, against a real ``ember worker --openwhisk`` process and a
real pool. No OpenWhisk runs here: the test plays the invoker."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_pool.client import PoolClient
from runtime.openwhisk import SENTINEL, ActionError, Activation, InitValue
from tests.conftest import PoolProcess
from tests.runtime.pod_worker import Home, free_port, make_home, read, start_worker, wait_status

# A plain (threaded) handler reporting what an activation sees.
ECHO_HANDLER = """
import os
import time


def main(event, context):
    if event.get("fail"):
        raise RuntimeError("asked to fail")
    if event.get("not_json"):
        return {"set": {1, 2}}
    start = time.time()
    time.sleep(float(event.get("sleep", 0)))
    text = context.model.complete("hi", max_tokens=3, temperature=0).text
    return {
        "activation": os.environ.get("__OW_ACTIVATION_ID"),
        "namespace": context.env.get("__OW_NAMESPACE"),
        "deadline": os.environ.get("__OW_DEADLINE"),
        "remaining": context.remaining_time(),
        "request_id": context.request_id,
        "greeting": os.environ.get("GREETING"),
        "start": start,
        "end": time.time(),
        "text": text,
    }
"""


# ----- the messages ------------------------------------------------------------------------------


def test_init_value_carries_the_spec_and_environment() -> None:
    body = {"value": {"code": "spec text", "env": {"GREETING": "hi", "N": 3}, "name": "/guest/echo",
                      "main": "main", "binary": False}}  # fmt: skip
    value = InitValue.from_body(json.dumps(body).encode())
    assert value == InitValue("spec text", {"GREETING": "hi", "N": "3"}, "/guest/echo")
    assert InitValue.from_body(b"{}") == InitValue(None)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"[1]", "JSON object"),
        (b"{not json", "valid JSON"),
        (b'{"value": []}', "value"),
        (b'{"value": {"code": "UEsDB", "binary": true}}', "archive"),
        (b'{"value": {"code": 7}}', "value.code"),
        (b'{"value": {"env": {"EMBER_POOL_DIR": "/tmp"}}}', "EMBER_POOL_DIR"),
        (b'{"value": {"env": {"__OW_API_KEY": "x"}}}', "__OW_API_KEY"),
        (b'{"value": {"env": {"A=B": "x"}}}', "A=B"),
        (b'{"value": {"env": {"A": "\\u0000"}}}', "NUL"),
        # Regressions: what the process and its children load or run is not the action's to set.
        (b'{"value": {"env": {"LD_PRELOAD": "/tmp/x.so"}}}', "LD_PRELOAD"),
        (b'{"value": {"env": {"PYTHONPATH": "/tmp"}}}', "PYTHONPATH"),
        (b'{"value": {"env": {"PATH": "/tmp"}}}', "PATH"),
        (b'{"value": {"env": {"GLIBC_TUNABLES": "x"}}}', "GLIBC_TUNABLES"),
        (b'{"value": {"env": {"ld_library_path": "/tmp"}}}', "ld_library_path"),
    ],
)
def test_bad_init_bodies_are_400s(body: bytes, needle: str) -> None:
    with pytest.raises(ActionError, match=needle) as info:
        InitValue.from_body(body)
    assert info.value.status == 400


def test_run_fields_become_the_activation_environment() -> None:
    body = {"value": {"prompt": "x"}, "namespace": "guest", "action_name": "/guest/echo",
            "activation_id": "a1", "deadline": "1700000000123", "transaction_id": "t"}  # fmt: skip
    activation = Activation.from_body(json.dumps(body).encode(), now=1.0)
    assert activation.params == {"prompt": "x"} and activation.activation_id == "a1"
    assert activation.deadline == pytest.approx(1700000000.123)
    assert activation.env == {"__OW_NAMESPACE": "guest", "__OW_ACTION_NAME": "/guest/echo",
                              "__OW_ACTIVATION_ID": "a1", "__OW_DEADLINE": "1700000000123",
                              "__OW_TRANSACTION_ID": "t"}  # fmt: skip
    bare = Activation.from_body(b'{"value": {}}', now=100.0)
    assert bare.deadline == 160.0 and bare.env == {} and bare.activation_id
    for bad in (b'{"value": 3}', b'{"value": {}, "deadline": "soon"}', b'{"value": {}, "bad-name": 1}'):
        with pytest.raises(ActionError) as info:
            Activation.from_body(bad, now=1.0)
        assert info.value.status == 400
    # Regression: a deadline already past ran the activation anyway (its result unwanted).
    with pytest.raises(ActionError, match="deadline passed") as info:
        Activation.from_body(json.dumps(body).encode(), now=1700000001.0)
    assert info.value.status == 400


def test_failed_inits_can_be_retried_and_bodies_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    from fastapi.testclient import TestClient

    from runtime.openwhisk import ActionState, build_openwhisk_app
    from runtime.worker_guard import BodyLimit

    def prepare(value: InitValue) -> Any:
        raise ValueError(f"no model for {value.code!r}")

    action = ActionState()
    with TestClient(BodyLimit(build_openwhisk_app(action, prepare), 4096)) as http:
        for _ in range(2):  # a failed /init is not "initialized": the invoker may try again
            failed = http.post("/init", json={"value": {"code": "spec", "env": {"OW_PROBE_VAR": "1"}}})
            assert failed.status_code == 502 and "no model for 'spec'" in failed.json()["error"]
            assert "OW_PROBE_VAR" not in os.environ  # regression: a failed /init's env stayed
        assert not action.initialized
        assert http.post("/init", content=b"[]").status_code == 400
        assert http.post("/run", json={"value": {}}).status_code == 502  # not initialized
        big = http.post("/run", content=b"{" + b" " * 8192 + b"}")
        assert big.status_code == 413
        assert http.get("/openapi.json").status_code == 404 and http.get("/docs").status_code == 404
    out, err = capsys.readouterr()
    assert out.count(SENTINEL) == 4 and err.count(SENTINEL) == 4  # two failed inits, a bad one, a run


# ----- the action, against a real process --------------------------------------------------------


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Home:
    home = make_home(tmp_path_factory.mktemp("tiny"))
    (home.path / "functions" / "echo.py").write_text(ECHO_HANDLER)
    return home


@pytest.fixture
def action(home: Home, tmp_path: Path) -> Iterator[tuple[str, PoolProcess, Any, Path]]:
    """(URL, the node's pool, the worker process, its logs) of an uninitialized action."""
    run = tmp_path / "run"
    run.mkdir()
    pool = PoolProcess(run / "cpu.sock", "16MiB", store=(home.path / "models",))
    port = free_port()
    env = {"EMBER_HOME": str(home.path), "EMBER_POOL_DIR": str(run)}
    proc = start_worker(["--openwhisk", "--port", str(port)], {**_environ(), **env}, tmp_path / "logs")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_status(f"{url}/healthz", 200, proc, tmp_path / "logs", timeout=120)
        yield url, pool, proc, tmp_path / "logs"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pool.stop()


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def _spec(home: Home) -> str:
    return f"""
apiVersion: ember.dev/v1
kind: Function
metadata: {{name: echo}}
spec:
  model: {{source: "{home.model.record["source"]}", dtype: float32}}
  handler: echo.py:main
  maxTokens: 32
"""


def _markers(logs: Path) -> tuple[int, int]:
    return read(logs / "stdout").count(SENTINEL), read(logs / "stderr").count(SENTINEL)


@pytest.mark.slow
def test_init_once_then_activations_with_their_environment_markers_and_kv_released(
    home: Home, action: tuple[str, PoolProcess, Any, Path]
) -> None:
    url, pool, proc, logs = action
    with httpx.Client(base_url=url, timeout=120) as http:
        early = http.post("/run", json={"value": {}})
        assert early.status_code == 502 and "not initialized" in early.json()["error"]
        assert _markers(logs) == (1, 1)

        init = {"value": {"code": _spec(home), "env": {"GREETING": "hello"}, "name": "/guest/echo"}}
        assert http.post("/init", json=init).json() == {"ok": True}
        again = http.post("/init", json=init)
        assert again.status_code == 403 and "more than once" in again.json()["error"]

        deadline_ms = int((time.time() + 30) * 1000)
        run = {"value": {}, "namespace": "guest", "action_name": "/guest/echo", "activation_id": "act-1",
               "deadline": str(deadline_ms), "transaction_id": "tx"}  # fmt: skip
        result = http.post("/run", json=run)
        assert result.status_code == 200, result.text
        body = result.json()
        assert (body["activation"], body["namespace"], body["request_id"]) == ("act-1", "guest", "act-1")
        assert body["deadline"] == str(deadline_ms) and body["greeting"] == "hello"
        assert 20 < body["remaining"] <= 30  # the deadline is the handler's remaining_time
        assert _markers(logs) == (2, 2)
        with PoolClient(pool.socket_path) as observer:
            stats = observer.stats()
        assert stats["num_kv_blocks"] == 0  # KV returned at the end of the activation
        assert stats["pinned_bytes"] > 0  # the weights stay pinned by the action's session

        # The activation's environment is its own: the next one without a namespace sees none.
        bare = http.post("/run", json={"value": {}, "activation_id": "act-2"}).json()
        assert bare["namespace"] is None and bare["activation"] == "act-2"

        failed = http.post("/run", json={"value": {"fail": True}, "activation_id": "act-3"})
        assert failed.status_code == 502 and "asked to fail" in failed.json()["error"]
        odd = http.post("/run", json={"value": {"not_json": True}})
        assert odd.status_code == 502 and "not JSON" in odd.json()["error"]
        bad = http.post("/run", json={"value": [1, 2]})
        assert bad.status_code == 400 and "error" in bad.json()
        assert _markers(logs) == (6, 6)

        # Activations do not overlap, whatever the invoker sends at once.
        spans: list[tuple[float, float]] = []

        def activate(i: int) -> None:
            reply = http.post("/run", json={"value": {"sleep": 0.4}, "activation_id": f"s{i}"}).json()
            spans.append((reply["start"], reply["end"]))

        threads = [threading.Thread(target=activate, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        spans.sort()
        assert len(spans) == 3
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, read(logs / "stderr")[-3000:]
    with PoolClient(pool.socket_path) as observer:
        assert observer.stats()["pinned_bytes"] == 0  # the session is released, the weights resident


@pytest.mark.slow
def test_the_default_handler_honours_response_format(
    home: Home, action: tuple[str, PoolProcess, Any, Path]
) -> None:
    """An activation's response_format goes through constrained decoding, as on
    /v1/chat/completions (it was accepted and then ignored: free text came back). Tools take
    the same path (prepare_all); the tiny model's 256-token context cannot hold their prompt."""
    url, _, _, _ = action
    spec = f"""
apiVersion: ember.dev/v1
kind: Function
metadata: {{name: chat}}
spec:
  model: {{source: "{home.model.record["source"]}", dtype: float32}}
  maxTokens: 48
"""
    ask = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=url, timeout=120) as http:
        init = {"value": {"code": spec, "name": "/guest/chat"}}
        assert http.post("/init", json=init).json() == {"ok": True}
        for seed in range(3):
            value = {"messages": ask, "response_format": {"type": "json_object"}, "seed": seed}
            reply = http.post("/run", json={"value": value, "activation_id": f"j{seed}"})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"].startswith("{")
