"""How the node agent starts and restarts workers: a credential, a scrubbed environment, backoff.

A worker runs function code the operator did not write, so it inherits no secret: its
environment drops ``EMBER_REDIS_URL`` and every variable whose name mentions a key, token,
secret, password or credential (``EMBER_API_KEY`` included). Its own credential, issued by
the agent, reaches it over stdin. Pre-warmed workers that keep failing to start are
restarted with capped exponential backoff, and the agent reports the failures.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
SECRET_NAMES = frozenset({"EMBER_REDIS_URL"})  # may carry a Redis password


def new_token() -> str:
    """A fresh per-worker credential (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def is_secret(name: str) -> bool:
    """Whether an environment variable may carry a secret (workers do not inherit it)."""
    upper = name.upper()
    return upper in SECRET_NAMES or any(marker in upper for marker in SECRET_MARKERS)


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables that :func:`is_secret` names."""
    return {k: v for k, v in environ.items() if not is_secret(k)}


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    """Delays (s) between attempts to start a worker after consecutive failures."""

    initial_s: float = 1.0
    max_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")


class SpawnBackoff:
    """Consecutive start failures of pre-warmed workers and when the next try may run.

    After ``n`` failures in a row the next start waits ``min(max_s, initial_s * 2**(n-1))``
    seconds; a successful start resets it.
    """

    def __init__(self, config: BackoffConfig) -> None:
        self.config = config
        self.failures = 0
        self.last_error: str | None = None
        self._until = 0.0  # time.monotonic() before which no new start is tried

    def failed(self, error: str) -> float:
        """Record a failed start; returns the delay before the next attempt (s)."""
        self.failures += 1
        self.last_error = error[-1000:]
        delay: float = min(self.config.max_s, self.config.initial_s * 2.0 ** min(self.failures - 1, 30))
        self._until = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        """A worker started: the next failure starts the backoff again from ``initial_s``."""
        self.failures = 0
        self._until = 0.0

    def remaining_s(self) -> float:
        """Seconds until the next start may be tried (0 when not backing off)."""
        return max(0.0, self._until - time.monotonic()) if self.failures else 0.0

    def report(self) -> dict[str, object]:
        """What the agent publishes in its device records (``/v1/cluster`` shows it)."""
        return {
            "worker_failures": self.failures,
            "backoff_s": round(self.remaining_s(), 3),
            "last_worker_error": self.last_error if self.failures else None,
        }
