"""The gateway's HTTP edge against hostile clients: body caps, read timeouts, deep JSON/YAML.

One real ``ember serve`` per module, without pre-warmed workers (nothing here reaches a
worker: every request is refused at the edge), with 1 s body and header timeouts. Raw
sockets control every byte and show what happens to the connection.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.spawn import ServeProcess
from scheduler.redis_server import EmbeddedRedis
from scheduler.spec import parse_function
from tests.proc_memory import memory_kib
from tests.rawhttp import (
    assert_error,
    closed_by_peer,
    connect,
    read_response,
    read_responses,
    request_bytes,
)

pytestmark = pytest.mark.slow

MB = 1 << 20
INVOCATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/functions/edge/invoke")
JSON = {"content-type": "application/json"}
YAML = {"content-type": "application/yaml"}


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    env = {
        "EMBER_PREWARM": "0",
        "EMBER_ARENA": "64MiB",
        "EMBER_BODY_TIMEOUT": "1",
        "EMBER_HEADER_TIMEOUT": "1",
    }
    proc = ServeProcess(tmp_path_factory.mktemp("edge-home"), env=env)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


@pytest.mark.parametrize("path", [*INVOCATION_PATHS, "/v1/functions"])
def test_a_declared_oversized_body_is_413_before_it_is_read(edge: ServeProcess, path: str) -> None:
    with connect(edge.url) as sock:
        t0 = time.perf_counter()
        sock.sendall(request_bytes("POST", path, headers={**JSON, "content-length": str(50 * MB)}))
        response = read_response(sock)
        elapsed = time.perf_counter() - t0
        assert_error(response, 413, "request_too_large")
        assert elapsed < 0.1, f"413 took {elapsed * 1e3:.0f} ms"
        assert response.headers["connection"] == "close"  # the unread body cannot be skipped
        assert closed_by_peer(sock)


def test_the_spec_cap_is_smaller_than_the_invocation_cap(edge: ServeProcess) -> None:
    with httpx.Client(base_url=edge.url) as http:
        spec = http.post("/v1/functions", content=b" " * (MB + 1), headers=JSON)
        assert spec.status_code == 413, spec.text
        event = http.post("/v1/functions/edge/invoke", content=b" " * (MB + 1), headers=JSON)
        assert event.status_code == 400, event.text  # read whole (below 4 MiB): not JSON


def test_a_chunked_50mb_body_is_stopped_at_the_cap_without_memory_growth(edge: ServeProcess) -> None:
    before = memory_kib(edge.proc.pid)
    with connect(edge.url) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n"
        piece = b"%x\r\n%s\r\n" % (MB, b"[" * MB)  # one 1 MiB chunk

        def send() -> None:
            try:
                sock.sendall(head + b"content-type: application/json\r\n\r\n")
                for _ in range(50):
                    sock.sendall(piece)
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the server stopped reading: expected

        sender = threading.Thread(target=send)
        t0 = time.perf_counter()
        sender.start()
        response = read_response(sock)
        elapsed = time.perf_counter() - t0
        assert_error(response, 413, "request_too_large")
        assert elapsed < 1.0, f"413 took {elapsed:.2f} s"
        assert closed_by_peer(sock)
        sender.join(10)
    after = memory_kib(edge.proc.pid)
    # The cap (4 MiB) may be buffered; the other 46 MB must never be.
    assert after["VmHWM"] - before["VmHWM"] < 24 << 10, (before, after)
    assert after["VmRSS"] - before["VmRSS"] < 24 << 10, (before, after)


@pytest.mark.parametrize("path", [INVOCATION_PATHS[0], INVOCATION_PATHS[2], "/v1/functions"])
def test_a_trickled_body_is_408_after_the_body_timeout(edge: ServeProcess, path: str) -> None:
    with connect(edge.url) as sock:
        sock.sendall(request_bytes("POST", path, headers={**JSON, "content-length": "100"}) + b'{"a": ')
        t0 = time.perf_counter()
        response = read_response(sock)
        assert_error(response, 408, "request_timeout")
        assert 0.9 < time.perf_counter() - t0 < 3.0
        assert closed_by_peer(sock)


def test_slow_headers_are_408_after_the_header_timeout(edge: ServeProcess) -> None:
    with connect(edge.url) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n")
        for byte in b"x-slow: 1234567890":  # one byte every 0.2 s, for longer than the timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if time.perf_counter() - t0 > 1.5:
                break
        response = read_response(sock)
        assert_error(response, 408, "request_timeout")
        assert closed_by_peer(sock)
        assert time.perf_counter() - t0 < 3.0
    with connect(edge.url) as idle:  # connected, nothing sent: closed after the timeout too
        t0 = time.perf_counter()
        assert_error(read_response(idle), 408, "request_timeout")
        assert 0.9 < time.perf_counter() - t0 < 3.0


def test_oversized_headers_are_431_without_memory_growth(edge: ServeProcess) -> None:
    """httptools buffers headers whole: 64 MB of header lines once grew the gateway by 64 MB."""
    before = memory_kib(edge.proc.pid)
    with connect(edge.url) as sock:
        line = b"x-big: " + b"a" * MB + b"\r\n"

        def send() -> None:
            try:
                sock.sendall(b"GET /v1/functions HTTP/1.1\r\nhost: t\r\n")
                for _ in range(64):
                    sock.sendall(line)
            except OSError:
                pass  # the server closed the connection: expected

        sender = threading.Thread(target=send)
        sender.start()
        assert_error(read_response(sock), 431, "request_too_large")
        assert closed_by_peer(sock)
        sender.join(10)
    after = memory_kib(edge.proc.pid)
    assert after["VmHWM"] - before["VmHWM"] < 24 << 10, (before, after)
    with connect(edge.url) as sock:  # many small headers within the cap still serve
        extra = b"".join(b"x-h%d: v\r\n" % i for i in range(500))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: t\r\n" + extra + b"\r\n")
        assert read_response(sock).status == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nbad header line\r\n\r\n",
        b"POST /v1/functions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_malformed_requests_are_400_with_embers_error_body(edge: ServeProcess, raw: bytes) -> None:
    """Not uvicorn's ``text/plain`` "Invalid HTTP request received.": the same JSON as every error."""
    with connect(edge.url) as sock:
        sock.sendall(raw)
        response = read_response(sock)
        assert "malformed HTTP/1.1 request" in assert_error(response, 400, "invalid_request_error")
        assert response.headers["connection"] == "close"
        assert closed_by_peer(sock)
    with connect(edge.url) as sock:  # a malformed successor: answered after the request before it
        sock.sendall(request_bytes("GET", "/healthz") * 2 + b"NOT HTTP\r\n\r\n")
        first, second, refusal = read_responses(sock, 3)
        assert first.status == second.status == 200 and first.json()["status"] == "ok"
        assert_error(refusal, 400, "invalid_request_error")
        assert closed_by_peer(sock)


def test_a_keep_alive_connection_outlives_the_header_timeout(edge: ServeProcess) -> None:
    with connect(edge.url) as sock:
        for _ in range(3):  # requests 0.6 s apart on one connection, 1.8 s > the 1 s timeout
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock).status == 200
            time.sleep(0.6)


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000


def test_deep_json_is_400_everywhere(edge: ServeProcess) -> None:
    nested = json.dumps({"model": "edge", "messages": [], "x": [[[[[[[[[[]]]]]]]]]] * 1}).encode()
    too_deep = b'{"model": "edge", "messages": ' + b"[" * 70 + b"]" * 70 + b"}"
    with httpx.Client(base_url=edge.url) as http:
        for path in INVOCATION_PATHS:
            for body in (DEEP_JSON, too_deep):
                response = http.post(path, content=body, headers=JSON)
                assert response.status_code == 400, (path, response.text)
                assert response.json()["error"]["type"] == "invalid_request_error"
                assert "nested deeper than 64" in response.json()["error"]["message"]
            assert http.post(path, content=nested, headers=JSON).status_code == 404  # no such function
        spec = http.post("/v1/functions", content=DEEP_JSON, headers=JSON)
        assert spec.status_code == 400 and spec.json()["error"]["type"] == "invalid_function_spec"


HUGE_INT = "9" * 5000  # Python refuses to convert integers over 4300 digits (a ValueError)


def test_an_integer_of_5000_digits_is_400_on_the_same_connection(edge: ServeProcess) -> None:
    chat = f'{{"model": "edge", "messages": [], "max_tokens": {HUGE_INT}}}'.encode()
    spec_yaml = f"apiVersion: ember.dev/v1\nkind: Function\nmetadata: {{name: a}}\nspec: {{n: {HUGE_INT}}}\n"
    requests = [
        (request_bytes("POST", path, chat, JSON), "invalid_request_error") for path in INVOCATION_PATHS
    ] + [
        (
            request_bytes("POST", "/v1/functions", f'{{"n": {HUGE_INT}}}'.encode(), JSON),
            "invalid_function_spec",
        ),
        (request_bytes("POST", "/v1/functions", spec_yaml.encode(), YAML), "invalid_function_spec"),
        (request_bytes("POST", "/v1/tenants", f'{{"namespace": {HUGE_INT}}}'.encode(), JSON), None),
    ]
    with connect(edge.url) as sock:
        for raw, kind in requests:
            sock.sendall(raw)
            response = read_response(sock)
            assert response.status == 400, (raw[:60], response.body)
            if kind is not None:
                assert json.loads(response.body)["error"]["type"] == kind, response.body
            assert response.headers.get("connection") != "close"
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock).status == 200, raw[:60]


BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def test_hostile_yaml_is_400_or_413(edge: ServeProcess) -> None:
    with httpx.Client(base_url=edge.url) as http:
        for text in ("[" * 100_000, "a:\n" + "".join(" " * i + "- \n" for i in range(1, 400)), BOMB):
            response = http.post("/v1/functions", content=text, headers=YAML)
            assert response.status_code == 400, response.text[:300]
            assert "malformed YAML" in response.json()["error"]["message"]
        huge = http.post("/v1/functions", content="a: [" + "1, " * 400_000 + "]", headers=YAML)
        assert huge.status_code == 413


def test_yaml_is_parsed_off_the_event_loop(edge: ServeProcess) -> None:
    """A large spec (256 KiB, under the 1 MiB cap) is parsed while /healthz keeps answering."""
    text = "apiVersion: ember.dev/v1\nkind: Function\nmetadata: {name: big}\nspec:\n  notes:\n"
    text += "".join(f"  - {{k: item-{i}, v: [1, 2]}}\n" for i in range(8000))
    assert len(text) < 256 << 10
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=edge.url, timeout=60) as http:
            while not done.is_set():
                t0 = time.perf_counter()
                assert http.get("/healthz").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.1)
        with httpx.Client(base_url=edge.url, timeout=30) as http:
            for _ in range(3):
                response = http.post("/v1/functions", content=text, headers=YAML)
                assert response.status_code == 400, response.text  # far too many nodes for a spec
        time.sleep(0.1)
    finally:
        done.set()
        prober.join(10)
    assert len(latencies) > 10 and max(latencies) < 0.2, f"/healthz took up to {max(latencies):.3f} s"


def test_errors_keep_the_connection_alive(edge: ServeProcess) -> None:
    """Each erroring request (body read whole) is answered and the same connection serves the next."""
    bad_spec = json.dumps({"apiVersion": "ember.dev/v1", "kind": "Function"}).encode()
    errors = [
        (request_bytes("POST", "/v1/functions", DEEP_JSON, JSON), 400),
        (request_bytes("POST", "/v1/functions", bad_spec, JSON), 400),
        (request_bytes("GET", "/v1/functions/nothing-here"), 404),
        (request_bytes("DELETE", "/v1/functions/nothing-here"), 404),
        (request_bytes("POST", "/v1/chat/completions", DEEP_JSON, JSON), 400),
        (request_bytes("POST", "/v1/chat/completions", b'{"model": "nothing-here"}', JSON), 404),
        (request_bytes("POST", "/v1/functions/nothing-here/invoke", b"{}", JSON), 404),
        (request_bytes("GET", "/v1/functions/x/logs?tail=many"), 400),
    ]
    with connect(edge.url) as sock:
        for raw, status in errors:
            sock.sendall(raw)
            response = read_response(sock)
            assert response.status == status, (raw[:60], response.body)
            assert response.headers.get("connection") != "close"
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock).status == 200, raw[:60]


def test_unknown_routes_and_methods_answer_embers_error_body(edge: ServeProcess) -> None:
    """Not FastAPI's ``{"detail": ...}``: every error is OpenAI's ``{"error": {...}}``."""
    with connect(edge.url) as sock:
        for raw, status, kind in (
            (request_bytes("GET", "/v1/nothing-here"), 404, "not_found"),
            (request_bytes("POST", "/v1/functions/a%2Fb/invoke", b"{}", JSON), 404, "not_found"),
            (request_bytes("PUT", "/v1/functions"), 405, "method_not_allowed"),
        ):
            sock.sendall(raw)
            assert_error(read_response(sock), status, kind)


def test_docs_are_open_on_an_unkeyed_server(edge: ServeProcess) -> None:
    with httpx.Client(base_url=edge.url) as http:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 200, path


def test_docs_need_the_key_on_a_keyed_server(tmp_path: Path) -> None:
    key = "edge-" + "k" * 27
    env = {"EMBER_API_KEY": key, "EMBER_PREWARM": "0", "EMBER_ARENA": "64MiB"}
    proc = ServeProcess(tmp_path / "home", env=env)
    try:
        with httpx.Client(base_url=proc.url) as http:
            for path in ("/docs", "/redoc", "/openapi.json"):
                denied = http.get(path)
                assert denied.status_code == 401, path
                assert denied.json()["error"]["type"] == "authentication_error"
                allowed = http.get(path, headers={"authorization": f"Bearer {key}"})
                assert allowed.status_code == 200, path
            schema = http.get("/openapi.json", headers={"authorization": f"Bearer {key}"}).json()
            assert "/v1/functions" in schema["paths"]
    finally:
        assert proc.stop() == 0


def test_redis_refusing_writes_is_503_with_retry_after(edge: ServeProcess) -> None:
    """An invocation of a deployed function with no instance must start one: a Redis write."""
    document = parse_function(
        {
            "apiVersion": "ember.dev/v1",
            "kind": "Function",
            "metadata": {"name": "oom"},
            "spec": {"model": {"source": "gguf:/nonexistent.gguf"}},
        }
    ).to_document()
    admin = redis.Redis.from_url(EmbeddedRedis(edge.home / "redis").url)  # its password file
    # Never started (Redis refuses the instance record first): the model need not exist.
    model = {"id": "oom-model", "dir": "/nonexistent", "weight_bytes": 1}
    record = {"v": 1, "spec": document, "model": model, "updated": time.time()}
    admin.hset("ember:functions", "oom", json.dumps(record))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:
        with connect(edge.url) as sock:
            sock.sendall(request_bytes("POST", "/v1/functions/oom/invoke", b"{}", JSON))
            response = read_response(sock)
            message = assert_error(response, 503, "state_out_of_memory")
            assert "state store cannot write" in message and int(response.headers["retry-after"]) >= 1
            sock.sendall(request_bytes("GET", "/healthz"))  # the connection stays usable
            assert read_response(sock).status == 200
    finally:
        admin.config_set("maxmemory", "0")
        admin.hdel("ember:functions", "oom")
        admin.close()


def test_a_state_conflict_is_sent_as_its_code(edge: ServeProcess) -> None:
    admin = redis.Redis.from_url(EmbeddedRedis(edge.home / "redis").url)  # its password file
    admin.hset("ember:functions", "from-the-future", json.dumps({"v": 99, "spec": {}}))
    try:
        with httpx.Client(base_url=edge.url) as http:
            response = http.get("/v1/functions/from-the-future")
            assert response.status_code == 409
            assert response.json()["error"]["type"] == "state_conflict"  # StateConflict.code
    finally:
        admin.hdel("ember:functions", "from-the-future")
        admin.close()
