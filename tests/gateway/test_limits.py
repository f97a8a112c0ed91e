"""Edge and deploy limits: configuration from EMBER_* variables (failing loudly), depth-bounded JSON."""

from __future__ import annotations

import pytest

from gateway.limits import (
    DEFAULT_MAX_FUNCTIONS,
    DEFAULT_MAX_MIN_SCALE,
    DeployLimits,
    EdgeLimits,
    JSONError,
    load_json,
)


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EdgeLimits.from_env() == EdgeLimits()
    monkeypatch.setenv("EMBER_MAX_BODY_BYTES", "1024")
    monkeypatch.setenv("EMBER_BODY_TIMEOUT", "2.5")
    limits = EdgeLimits.from_env()
    assert limits.max_body_bytes == 1024 and limits.body_timeout_s == 2.5
    assert limits.max_spec_bytes == 1 << 20 and limits.headers.header_timeout_s == 10.0
    monkeypatch.setenv("EMBER_HEADER_TIMEOUT", "3")
    monkeypatch.setenv("EMBER_MAX_HEADER_BYTES", "4096")
    headers = EdgeLimits.from_env().headers
    assert (headers.header_timeout_s, headers.max_header_bytes) == (3.0, 4096)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("EMBER_MAX_BODY_BYTES", "4MiB"),
        ("EMBER_MAX_BODY_BYTES", "0"),
        ("EMBER_MAX_SPEC_BYTES", "-1"),
        ("EMBER_BODY_TIMEOUT", "soon"),
        ("EMBER_HEADER_TIMEOUT", "0"),
        ("EMBER_HEADER_TIMEOUT", "nan"),
        ("EMBER_MAX_HEADER_BYTES", "1023"),
        ("EMBER_MAX_HEADER_BYTES", "64KiB"),
    ],
)
def test_bad_limits_fail_loudly(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="EMBER_"):
        EdgeLimits.from_env()


def test_the_function_quota_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DeployLimits.from_env().max_functions_per_namespace == DEFAULT_MAX_FUNCTIONS
    monkeypatch.setenv("EMBER_MAX_FUNCTIONS_PER_NAMESPACE", "7")
    assert DeployLimits.from_env() == DeployLimits(7)
    for bad in ("0", "-1", "many", "1e3", "1000001"):
        monkeypatch.setenv("EMBER_MAX_FUNCTIONS_PER_NAMESPACE", bad)
        with pytest.raises(ValueError, match="EMBER_MAX_FUNCTIONS_PER_NAMESPACE"):
            DeployLimits.from_env()


def test_the_min_scale_quota_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DeployLimits.from_env().max_min_scale_per_namespace == DEFAULT_MAX_MIN_SCALE
    monkeypatch.setenv("EMBER_MAX_MIN_SCALE_PER_NAMESPACE", "0")  # no instance kept up without requests
    assert DeployLimits.from_env() == DeployLimits(DEFAULT_MAX_FUNCTIONS, 0)
    for bad in ("-1", "many", "2.5", "1000001"):
        monkeypatch.setenv("EMBER_MAX_MIN_SCALE_PER_NAMESPACE", bad)
        with pytest.raises(ValueError, match="EMBER_MAX_MIN_SCALE_PER_NAMESPACE"):
            DeployLimits.from_env()


def test_load_json_bounds_depth() -> None:
    assert load_json(b'{"a": [[1], {"b": 2}]}') == {"a": [[1], {"b": 2}]}
    assert load_json("[" * 64 + "]" * 64) is not None
    for deep in (b"[" * 65 + b"]" * 65, b"[" * 100_000, b'{"a":' * 50_000):
        with pytest.raises(JSONError, match="nested deeper than 64"):
            load_json(deep)
    for bad in (b"{", b"\xff", b"[1,]"):
        with pytest.raises(JSONError):
            load_json(bad)


def test_a_bad_log_level_fails_loudly() -> None:
    from gateway.serve import configure_logging

    with pytest.raises(ValueError, match="EMBER_LOG_LEVEL must be one of"):
        configure_logging({"EMBER_LOG_LEVEL": "loud"})
