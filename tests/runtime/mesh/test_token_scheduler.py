"""Token-level grants on one device (LLM-Mesh §5.1)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.mesh.token_scheduler import TokenScheduler


def test_grants_the_least_headroom_first_one_at_a_time() -> None:
    s = TokenScheduler()
    s.want("a", deadline=5.0)
    s.want("b", deadline=2.0)
    s.want("c", deadline=2.0)  # same deadline as b: b asked first
    assert s.grant() == "b" and not s.leased
    assert s.grant() is None  # busy
    s.done("b")
    assert s.grant() == "c"
    s.done("c")
    assert s.grant() == "a" and s.leased  # nobody else waits: a lease


def test_a_lease_ends_when_another_instance_asks() -> None:
    s = TokenScheduler()
    s.want("a", 1.0)
    assert s.grant() == "a" and s.leased
    assert s.want("b", 9.0) is True  # a must yield after its iteration
    assert not s.leased and s.grant() is None
    s.done("a")
    assert s.grant() == "b"


def test_leaving_frees_the_device_and_misuse_is_an_error() -> None:
    s = TokenScheduler()
    s.want("a", 1.0)
    s.want("b", 2.0)
    assert s.grant() == "a"
    with pytest.raises(ValueError):
        s.want("a", 3.0)
    with pytest.raises(ValueError):
        s.done("b")
    s.leave("a")
    assert s.grant() == "b"


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.floats(0, 100), st.booleans()), max_size=60))
def test_never_two_at_once_and_always_the_earliest_deadline(events: list[tuple[str, float, bool]]) -> None:
    s = TokenScheduler()
    for inst, deadline, finish in events:
        if finish and s.running is not None:
            s.done(s.running)
        elif inst != s.running:
            s.want(inst, deadline)
        earliest = min((w.deadline for w in s.waiting.values()), default=None)
        was_free = s.running is None
        granted = s.grant()
        if was_free and earliest is not None:
            assert granted is not None
        if granted is not None:
            assert s.running == granted and granted not in s.waiting
            assert all(w.deadline >= earliest for w in s.waiting.values())  # type: ignore[operator]


def test_an_instance_passed_over_too_often_goes_next() -> None:
    s = TokenScheduler(max_passed_over=3)
    s.want("b", 10.0)
    grants = []
    for _ in range(8):  # a asks again at once, always with the earliest deadline
        s.want("a", -1e300)
        granted = s.grant()
        assert granted is not None
        grants.append(granted)
        s.done(granted)
        if granted == "b":
            s.want("b", 10.0)
    assert grants == ["a", "a", "a", "b", "a", "a", "a", "b"]
    with pytest.raises(ValueError, match="max_passed_over"):
        TokenScheduler(max_passed_over=0)
