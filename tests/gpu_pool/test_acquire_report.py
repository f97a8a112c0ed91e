"""The acquire report (issue 10): one type from the Reuse Store to the node agent, with a
versioned wire encoding that survives msgpack and JSON and refuses anything malformed."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import msgpack
import pytest

from gpu_pool.acquire_report import REPORT_FIELDS, REPORT_VERSION, AcquireReport
from gpu_pool.errors import InvalidArgument, ProtocolError, UnsupportedVersion
from gpu_pool.server.reuse_store import AcquireResult

REPORT = AcquireReport(
    bytes_loaded=1 << 40,
    bytes_reused=7,
    bytes_moved=0,
    bytes_evicted=3,
    load_seconds=0.25,
    plan_seconds=0.0,
    move_seconds=0.125,
)


def wire(**changes: Any) -> dict[str, Any]:
    return {**REPORT.to_wire(), **changes}


def test_round_trips_through_msgpack_and_json() -> None:
    encoded = REPORT.to_wire()
    assert encoded == {"v": REPORT_VERSION, **{name: getattr(REPORT, name) for name in REPORT_FIELDS}}
    assert AcquireReport.from_wire(msgpack.unpackb(msgpack.packb(encoded))) == REPORT
    assert AcquireReport.from_wire(json.loads(json.dumps(encoded))) == REPORT


def test_fields_in_order_and_whole_seconds_become_floats() -> None:
    assert tuple(f.name for f in dataclasses.fields(AcquireReport)) == REPORT_FIELDS
    report = AcquireReport.from_wire(wire(load_seconds=2, plan_seconds=0, move_seconds=1))
    assert all(
        isinstance(getattr(report, f), float) for f in ("load_seconds", "plan_seconds", "move_seconds")
    )
    assert report.load_bandwidth == (1 << 40) / 2 and REPORT.load_bandwidth == (1 << 40) * 4
    assert dataclasses.replace(REPORT, load_seconds=0.0).load_bandwidth == 0.0


def test_a_reuse_store_result_is_the_report_plus_placements_sent_apart() -> None:
    result = AcquireResult(**{name: getattr(REPORT, name) for name in REPORT_FIELDS}, placements={"w": 4096})
    assert isinstance(result, AcquireReport) and result.placements == {"w": 4096}
    assert result.to_wire() == REPORT.to_wire()  # the placements travel beside the report
    assert AcquireReport.from_wire(result.to_wire()) == REPORT


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ([1, 2], ProtocolError),
        (None, ProtocolError),
        (wire(v=REPORT_VERSION + 1), UnsupportedVersion),
        ({**{k: v for k, v in wire().items() if k != "move_seconds"}, "v": 1}, UnsupportedVersion),
        (wire(v=True), UnsupportedVersion),
        ({k: v for k, v in wire().items() if k != "v"}, UnsupportedVersion),
        ({k: v for k, v in wire().items() if k != "bytes_moved"}, ProtocolError),
        (wire(placements={}), ProtocolError),
        (wire(bytes_loaded="1"), ProtocolError),
        (wire(bytes_loaded=True), ProtocolError),
        (wire(bytes_loaded=1.0), ProtocolError),
        (wire(bytes_reused=-1), InvalidArgument),
        (wire(bytes_evicted=1 << 63), InvalidArgument),
        (wire(load_seconds="fast"), ProtocolError),
        (wire(load_seconds=False), ProtocolError),
        (wire(load_seconds=-0.5), InvalidArgument),
        (wire(plan_seconds=math.inf), InvalidArgument),
        (wire(plan_seconds=math.nan), InvalidArgument),
        (wire(move_seconds=-1e-9), InvalidArgument),
        ({k: v for k, v in wire().items() if k != "move_seconds"}, ProtocolError),
    ],
    ids=[
        "not-a-map", "none", "other-version", "version-1", "bool-version", "no-version", "missing-field",
        "extra-field",
        "string-count", "bool-count", "float-count", "negative-count", "count-past-int64", "string-seconds",
        "bool-seconds", "negative-seconds", "infinite-seconds", "nan-seconds", "negative-move-seconds",
        "no-move-seconds",
    ],
)  # fmt: skip
def test_malformed_reports_are_refused_with_typed_errors(data: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        AcquireReport.from_wire(data)
