"""bench.quiet: when a cold start may be timed."""

from __future__ import annotations

from bench.quiet import quiet


def test_quiet_needs_the_pre_warmed_workers_and_nothing_starting() -> None:
    ready = {"warm_workers": 2, "starting_workers": 0, "standby_preparing": 0}
    assert quiet([ready], 2)
    assert not quiet([{**ready, "warm_workers": 1}], 2)
    assert not quiet([ready, {"warm_workers": 0, "standby_preparing": 1}], 2)  # a standby on another device
    assert not quiet([{**ready, "starting_workers": 1}], 2)
    assert not quiet([], 1)
    assert quiet([{}], 0)  # an old report without the counters: nothing known to be starting
