"""bench.openai_stream: the benchmarks' percentile (nearest rank, as documented), and the
streaming client against a real SSE server on a socket (OpenAI's chunk shape)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import openai_stream
from bench.openai_stream import Target, concurrent_streams, http_client, pct, stream_chat


def test_pct_is_the_nearest_rank() -> None:
    eighty = [float(i) for i in range(1, 81)]
    assert pct(eighty, 0.99) == 80.0  # 0.99 * 80 = 79.2 values: the 80th (it was the 79th)
    assert pct(list(range(1, 101)), 0.99) == 99
    assert pct(list(range(1, 101)), 0.9) == 90
    assert pct([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert pct([5.0], 0.99) == 5.0
    assert pct([2.0, 1.0], 0.0) == 1.0 and pct([2.0, 1.0], 1.0) == 2.0


@pytest.mark.parametrize(("values", "q"), [([], 0.5), ([1.0], 1.5), ([1.0], -0.1)])
def test_pct_refuses_what_it_cannot_answer(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        pct(values, q)


class _Chat(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-word chunks, then usage and ``[DONE]``."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        n = int(body["max_tokens"])
        for i in range(n):
            chunk = {"choices": [{"delta": {"content": f"w{i} "}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def target() -> Iterator[Target]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Target(f"http://127.0.0.1:{server.server_address[1]}", "m")
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_made_beforehand_serves_several_requests(target: Target) -> None:
    with http_client() as client:
        first = stream_chat(target, 5, client=client)
        second = stream_chat(target, 3, client=client)  # not closed by the first request
    assert first.text == "w0 w1 w2 w3 w4 " and first.completion_tokens == 5 and first.prompt_tokens == 7
    assert second.completion_tokens == 3


def test_concurrent_streams_make_their_clients_before_the_start(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    sent_after: list[int] = []
    make = openai_stream.http_client

    def counting_client(timeout: float = 300.0) -> object:
        made.append(1)
        return make(timeout)

    real = openai_stream.stream_chat

    def noting(*args: object, **kwargs: object) -> openai_stream.Streamed:
        sent_after.append(len(made))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(openai_stream, "http_client", counting_client)
    monkeypatch.setattr(openai_stream, "stream_chat", noting)
    out = concurrent_streams(target, 4, 6)
    assert out["streams"] == 4 and out["tokens"] == 24
    assert sent_after == [4, 4, 4, 4]  # every client existed before any request went out
