"""Shadow validation of a request joining an instance (LLM-Mesh §5.3, its three cases)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.mesh.shadow import Case, ShadowInstance, ShadowRequest, validate
from runtime.mesh.slo import RequestClock, Slo
from runtime.mesh.time_table import TimeTable


def flat(prefill_per_token_s: float, decode_s: float) -> TimeTable:
    """Prefill linear in the length, decode constant: easy to reason about."""
    return TimeTable(
        (1, 1024), (prefill_per_token_s, prefill_per_token_s * 1024), (1, 64), (1, 4096),
        ((decode_s, decode_s), (decode_s, decode_s)),
    )  # fmt: skip


def running(start: float, input_len: int, out: int, slo: Slo, remaining: int = 100) -> ShadowRequest:
    return ShadowRequest(RequestClock(start, input_len, slo, out), remaining)


def test_admits_onto_an_idle_device_and_says_when_its_first_token_comes() -> None:
    inst = ShadowInstance("a", flat(0.001, 0.01))
    verdict = validate([inst], "a", running(100.0, 100, 0, Slo(2.0, 0.25)), now=100.0)
    assert verdict.admit and verdict.first_token_s is not None
    assert verdict.first_token_s == 100.0 + 0.1 * 1.1  # 100 tokens, overestimated by 10 %
    assert inst.requests == []  # the caller's state is untouched


def test_case_1_its_own_prefill_would_be_late() -> None:
    inst = ShadowInstance("a", flat(0.01, 0.01))  # 1000 tokens: 10 s of prefill
    verdict = validate([inst], "a", running(0.0, 1000, 0, Slo(2.0, 0.25)), now=0.0)
    assert not verdict.admit and verdict.case is Case.OWN_TTFT


def test_case_2_a_neighbour_would_be_late() -> None:
    slo = Slo(2.0, 0.25)
    # b waits for a 300-token prefill (0.33 s with the margin) due at 0.5 s: fine alone. The
    # new 250-token prompt is due at 0.3 s, so it runs first (0.275 s) and b's comes at 0.605 s.
    b = ShadowInstance("b", flat(0.001, 0.01), [running(-1.5, 300, 0, slo)])
    a = ShadowInstance("a", flat(0.001, 0.01))
    verdict = validate([a, b], "a", running(-1.7, 250, 0, slo), now=0.0)
    assert not verdict.admit and verdict.case is Case.NEIGHBOUR_LATE and verdict.late_instance == "b"
    # A short prompt (0.055 s) leaves b on time.
    assert validate([a, b], "a", running(-1.7, 50, 0, slo), now=0.0).admit


def test_case_3_one_decode_round_of_the_device_exceeds_the_tpot_slo() -> None:
    slo = Slo(2.0, 0.25)
    instances = [ShadowInstance(f"i{k}", flat(0.0001, 0.1), [running(0.0, 10, 1, slo)]) for k in range(2)]
    # Two instances decode at 0.1 s each (0.22 s with the margin): a third would need 0.33 s.
    third = ShadowInstance("i2", flat(0.0001, 0.1))
    verdict = validate([*instances, third], "i2", running(0.0, 10, 0, slo), now=0.0)
    assert not verdict.admit and verdict.case is Case.DEVICE_TPOT
    # Joining an instance that already decodes costs nothing more here (flat decode time).
    assert validate([*instances, third], "i0", running(0.0, 10, 0, slo), now=0.0).admit


def test_requests_already_late_do_not_block_admission() -> None:
    slo = Slo(2.0, 0.25)
    late = ShadowInstance("b", flat(0.001, 0.01), [running(-10.0, 10, 1, slo)])
    a = ShadowInstance("a", flat(0.001, 0.01))
    assert validate([a, late], "a", running(0.0, 50, 0, slo), now=0.0).admit


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 400), st.integers(0, 30), st.floats(0, 3)), max_size=6),
    st.integers(1, 800),
)
def test_an_admitted_request_keeps_every_slo_in_a_replay_of_the_simulation(
    existing: list[tuple[int, int, float]], prompt: int
) -> None:
    """Whatever the device holds, an admitted request's first token comes before its TTFT
    deadline, and a device with room admits a small request."""
    slo = Slo(2.0, 0.25)
    table = flat(0.0005, 0.004)
    instances = [ShadowInstance(f"i{k % 3}x{k}", table) for k in range(3)]
    for k, (length, out, age) in enumerate(existing):
        instances[k % 3].requests.append(running(-age, length, out, slo))
    verdict = validate(instances, instances[0].instance_id, running(0.0, prompt, 0, slo), now=0.0)
    if verdict.admit:
        assert verdict.first_token_s is not None
        assert verdict.first_token_s <= slo.ttft_for(prompt)
    else:
        assert verdict.case is not None


def test_a_slower_device_than_its_table_is_validated_at_its_measured_speed() -> None:
    """The engine's measured slowdown scales the table: what fits at profiled speed may not."""
    slo = Slo(2.0, 0.25)
    busy = ShadowInstance("b", flat(0.001, 0.01), [running(0.0, 10, 1, slo)])
    fast = ShadowInstance("a", flat(0.001, 0.01))
    new = running(0.0, 1000, 0, slo)  # 1.1 s of prefill at profiled speed
    assert validate([fast, busy], "a", new, now=0.0).admit
    slow = ShadowInstance("a", flat(0.001, 0.01), slowdown=3.0)  # 3.3 s now: past its 2 s TTFT
    assert validate([slow, busy], "a", new, now=0.0).case is Case.OWN_TTFT
