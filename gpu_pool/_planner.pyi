"""Type stub of the C extension built from gpu_pool/planner/csrc/."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

def plan(
    offsets: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
    movable: npt.NDArray[np.bool_],
    keys: list[str | None],
    base: int,
    end: int,
    request_sizes: Sequence[int],
    eviction_order: Sequence[str],
    prices: npt.NDArray[np.float64] | None,
    move_type: type[tuple[str, int, int, int]],
    global_merge: bool,
    move_seconds_per_byte: float,
    max_split_tries: int,
    /,
) -> tuple[list[int] | None, list[str], list[tuple[str, int, int, int]], int, int]: ...
def mce_order(
    keys: Sequence[str], per_byte_rates: Sequence[float], last_used: Sequence[float], sizes: Sequence[int], /
) -> list[str]: ...
