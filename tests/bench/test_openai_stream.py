"""The benchmarks' percentile (bench.openai_stream.pct): nearest rank, as documented."""

from __future__ import annotations

import pytest

from bench.openai_stream import pct


def test_pct_is_the_nearest_rank() -> None:
    eighty = [float(i) for i in range(1, 81)]
    assert pct(eighty, 0.99) == 80.0  # 0.99 * 80 = 79.2 values: the 80th (it was the 79th)
    assert pct(list(range(1, 101)), 0.99) == 99
    assert pct(list(range(1, 101)), 0.9) == 90
    assert pct([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert pct([5.0], 0.99) == 5.0
    assert pct([2.0, 1.0], 0.0) == 1.0 and pct([2.0, 1.0], 1.0) == 2.0


@pytest.mark.parametrize(("values", "q"), [([], 0.5), ([1.0], 1.5), ([1.0], -0.1)])
def test_pct_refuses_what_it_cannot_answer(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        pct(values, q)
