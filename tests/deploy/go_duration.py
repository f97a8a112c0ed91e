"""Go's ``time.ParseDuration`` (what Knative parses duration annotations with), in seconds."""

from __future__ import annotations

import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TERM = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
MAX_CHARS = 64  # a duration annotation longer than this is not one


def parse_duration(text: str) -> float:
    """Seconds in a Go duration such as ``10s``, ``1m30s``, ``1.5h`` or ``-2s``; ValueError if not one."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"{text[:MAX_CHARS]!r}...: too long for a duration")
    body, sign = text, 1.0
    if body[:1] in "+-" and body:
        sign, body = (-1.0 if body[0] == "-" else 1.0), body[1:]
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"{text!r} is not a Go duration (e.g. 10s, 1m30s)")
    total, at = 0.0, 0
    for match in _TERM.finditer(body):
        if match.start() != at:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        at = match.end()
    if at != len(body):
        raise ValueError(f"{text!r} is not a Go duration (e.g. 10s, 1m30s)")
    return sign * total
