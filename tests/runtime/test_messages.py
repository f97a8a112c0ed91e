"""Agent-to-worker messages: typed, bounded, and refused (a 400 at the worker) when malformed."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gpu_pool.acquire_report import REPORT_VERSION, AcquireReport
from runtime.messages import (
    MAX_MESSAGE_BYTES,
    AssignMessage,
    AssignReply,
    MessageError,
    PreloadMessage,
    ThreadsMessage,
)

SPEC: dict[str, Any] = {"metadata": {"name": "f"}, "spec": {"handler": "default", "maxTokens": 64}}


def assign_body(**changes: Any) -> dict[str, Any]:
    body = {"instance_id": "7", "spec": SPEC, "model_dir": "/m", "pool_socket": "/p.sock",
            "pool_ticket": "t", "deadline": time.time() + 60}  # fmt: skip
    return {**body, **changes}


def test_messages_round_trip() -> None:
    message = AssignMessage.from_json(json.dumps(assign_body()))
    assert (message.handler, message.max_tokens, message.pool_ticket) == ("default", 64, "t")
    assert AssignMessage.from_json(message.to_json()) == message
    assert PreloadMessage.from_json(PreloadMessage("/m").to_json()) == PreloadMessage("/m")
    assert ThreadsMessage.from_json(b'{"num_threads": 3}').num_threads == 3
    assert AssignMessage.from_json(json.dumps(assign_body(pool_ticket=None))).pool_ticket is None
    # The starting instance's share of the cores rides in the assignment (absent: keep the worker's).
    assert AssignMessage.from_json(json.dumps(assign_body(num_threads=2))).num_threads == 2
    assert AssignMessage.from_json(json.dumps(assign_body())).num_threads is None
    # So does its KV quota (what its pool ticket allows), which bounds a request's choices.
    assert AssignMessage.from_json(json.dumps(assign_body(kv_quota_bytes=1 << 20))).kv_quota_bytes == 1 << 20
    # And the function's registered LoRA adapters (absent: none).
    lora = AssignMessage.from_json(json.dumps(assign_body(adapters={"fr": "/m/adapters/fr"})))
    assert lora.adapters == {"fr": "/m/adapters/fr"} and AssignMessage.from_json(lora.to_json()) == lora
    assert AssignMessage.from_json(json.dumps(assign_body())).adapters == {}


@pytest.mark.parametrize(
    "body",
    [
        assign_body(instance_id=7),
        assign_body(instance_id=""),
        assign_body(spec="not a document"),
        assign_body(spec={"metadata": {}, "spec": {"handler": "default", "maxTokens": True}}),
        assign_body(model_dir="x" * 5000),
        assign_body(deadline="soon"),
        assign_body(deadline=float("inf")),
        assign_body(num_threads=0),
        assign_body(num_threads=True),
        assign_body(num_threads=1.5),
        assign_body(num_threads=10**6),
        assign_body(kv_quota_bytes=-1),
        assign_body(kv_quota_bytes="1GiB"),
        assign_body(kv_quota_bytes=False),
        assign_body(extra=1),
        assign_body(adapters=["/a"]),
        assign_body(adapters={"fr": 1}),
        assign_body(adapters={"": "/a"}),
        assign_body(adapters={f"a{i}": "/a" for i in range(17)}),
        {k: v for k, v in assign_body().items() if k != "deadline"},
        [1, 2],
    ],
)
def test_malformed_assign_bodies_are_refused(body: Any) -> None:
    with pytest.raises(MessageError):
        AssignMessage.from_json(json.dumps(body))


def test_malformed_preload_and_threads_bodies_and_oversized_or_deep_json_are_refused() -> None:
    bad = [b'{"num_threads": true}', b'{"num_threads": 0}', b'{"num_threads": 100000}', b"{}", b"nope"]
    for raw in bad:
        with pytest.raises(MessageError):
            ThreadsMessage.from_json(raw)
    for raw in (b'{"model_dir": 5}', b'{"model_dir": "/m", "x": 1}', b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(MessageError):
            PreloadMessage.from_json(raw)
    with pytest.raises(MessageError, match="larger than"):
        PreloadMessage.from_json(b" " * (MAX_MESSAGE_BYTES + 1))


REPORT = AcquireReport(
    bytes_loaded=0,
    bytes_reused=270_000_000,
    bytes_moved=0,
    bytes_evicted=0,
    load_seconds=0.0,
    plan_seconds=0.001,
    move_seconds=0.0,
)


def reply_body(**changes: Any) -> dict[str, Any]:
    body = {
        "instance_id": "7",
        "timings_ms": {"acquire_ms": 1.5, "assign_ms": 12},
        "acquire": REPORT.to_wire(),
    }
    return {**body, **changes}


def test_assign_reply_round_trips_with_the_pools_acquire_report() -> None:
    reply = AssignReply("7", {"acquire_ms": 1.5}, REPORT)
    assert AssignReply.from_json(reply.to_json()) == reply
    assert json.loads(reply.to_json())["acquire"] == REPORT.to_wire()  # versioned, as the pool sent it
    parsed = AssignReply.from_json(json.dumps(reply_body()))
    assert parsed.acquire == REPORT and parsed.acquire.bytes_reused == 270_000_000


@pytest.mark.parametrize(
    "body",
    [
        reply_body(instance_id=""),
        reply_body(timings_ms=[1.0]),
        reply_body(timings_ms={"x": "slow"}),
        reply_body(timings_ms={"x": True}),
        reply_body(timings_ms={"x": -1.0}),
        reply_body(timings_ms={"": 1.0}),
        reply_body(timings_ms={f"s{i}": 1.0 for i in range(65)}),
        reply_body(acquire={"bytes_loaded": 0}),  # the old unversioned dict
        reply_body(acquire={**REPORT.to_wire(), "v": REPORT_VERSION + 1}),
        reply_body(acquire={**REPORT.to_wire(), "bytes_loaded": -5}),
        reply_body(acquire=None),
        reply_body(extra=1),
        {k: v for k, v in reply_body().items() if k != "acquire"},
    ],
)
def test_malformed_assign_replies_are_refused(body: Any) -> None:
    with pytest.raises(MessageError):
        AssignReply.from_json(json.dumps(body))
