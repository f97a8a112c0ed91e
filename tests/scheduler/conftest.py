"""Scheduler test fixtures: a ClusterState over the session's real redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState


@pytest.fixture
def state(redis_server: EmbeddedRedis) -> Iterator[ClusterState]:
    s = ClusterState.from_url(redis_server.url)
    try:
        yield s
    finally:
        s.close()
