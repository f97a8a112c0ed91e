"""Typed cluster-state records: decoded once, versioned, and readable from data stored today."""

from __future__ import annotations

import json

import pytest

from scheduler.errors import StateConflict
from scheduler.records import DeviceReport, FunctionRecord, ModelRef, RecordError
from scheduler.state import ClusterState

SPEC = {
    "apiVersion": "ember.dev/v1",
    "kind": "Function",
    "metadata": {"name": "chat", "namespace": "team-a"},
    "spec": {
        "scaling": {"minScale": 1, "maxScale": 3, "keepAlive": "250ms", "concurrency": 2},
        "maxTokens": 64,
    },
}


def test_a_record_stored_before_types_reads_with_its_fields_parsed_once(state: ClusterState) -> None:
    stored = {"v": 1, "spec": SPEC, "model": {"id": "m1", "dir": "/s/m1", "weight_bytes": 10}, "updated": 5.0}
    state.r.hset("ember:functions", "team-a/chat", json.dumps(stored))  # the encoding written today
    record = state.function("team-a/chat")
    assert (record.namespace, record.name, record.max_tokens) == ("team-a", "chat", 64)
    assert (record.scaling.min_scale, record.scaling.max_scale, record.scaling.concurrency) == (1, 3, 2)
    assert record.scaling.keep_alive_s == 0.25
    assert record.model == ModelRef("m1", "/s/m1", 10)
    assert record.encode() == stored and state.get_record("team-a/chat") == stored


def test_defaults_fill_a_spec_without_scaling_and_a_bad_version_is_refused() -> None:
    record = FunctionRecord.create("f", {"metadata": {"name": "f"}})
    assert (record.scaling.concurrency, record.scaling.keep_alive_s, record.max_tokens) == (8, 10.0, 2048)
    assert (record.handler, record.model_source, record.model_dtype) == ("default", "", "bfloat16")
    custom = {"spec": {"handler": "/f/m.py:handler", "model": {"source": "pkg:a/b.gguf", "dtype": "q4"}}}
    parsed = FunctionRecord.create("f", custom)
    assert (parsed.handler, parsed.model_source, parsed.model_dtype) == (
        "/f/m.py:handler",
        "pkg:a/b.gguf",
        "q4",
    )
    with pytest.raises(StateConflict, match="version 2"):
        FunctionRecord.decode("f", json.dumps({"v": 2, "spec": {}}))
    for bad in ({"v": 1, "spec": []}, {"v": 1, "spec": {"spec": {"scaling": {"keepAlive": "soon"}}}}):
        with pytest.raises(RecordError):
            FunctionRecord.decode("f", json.dumps(bad))
    with pytest.raises(RecordError):
        ModelRef.decode({"id": "m", "dir": "/d", "weight_bytes": "many"})


def test_model_refs_carry_the_functions_lora_adapters() -> None:
    plain = ModelRef("m", "/d", 1)
    assert plain.encode() == {"id": "m", "dir": "/d", "weight_bytes": 1}  # as stored before adapters
    ref = ModelRef.decode({"id": "m", "dir": "/d", "weight_bytes": 1, "adapters": {"fr": "/d/adapters/fr"}})
    assert ref.adapters == (("fr", "/d/adapters/fr"),) and ModelRef.decode(ref.encode()) == ref
    for bad in (["/a"], {"fr": 3}):
        with pytest.raises(RecordError, match="adapters"):
            ModelRef.decode({"id": "m", "dir": "/d", "weight_bytes": 1, "adapters": bad})
    with pytest.raises(RecordError, match="at most 16"):
        ModelRef("m", "/d", 1, tuple((f"a{i}", "/a") for i in range(17)))


def test_device_reports_keep_the_published_document_and_parse_placement_inputs(state: ClusterState) -> None:
    published = {"free_bytes": 7, "evictable_bytes": 3, "models": {"m": 4}, "warm_workers": 1}
    state.report_device("n/cpu", published)
    report = state.device_reports()["n/cpu"]
    assert (report.free_bytes, report.evictable_bytes, report.resident_bytes) == (7, 3, {"m": 4})
    assert report.load_bandwidth == 0.0 and report.document["warm_workers"] == 1
    assert state.devices()["n/cpu"] == report.document and report.document["v"] == 1
    assert DeviceReport.decode("x", {"v": 1}).free_bytes == 0
