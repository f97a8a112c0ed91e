"""A handler's sampling arguments: NumPy and torch scalars pass as the numbers they hold, while
the request's types stay strict (runtime.sdk.context)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.openai_api import RequestError, parse_request
from runtime.sdk.context import _plain


def test_scalars_become_python_numbers_and_requests_parse() -> None:
    sampling = {
        "max_tokens": np.int64(5),
        "seed": torch.tensor(3),
        "temperature": np.float32(0.5),
        "stop": ["."],
    }
    plain = _plain(sampling)
    assert plain == {"max_tokens": 5, "seed": 3, "temperature": 0.5, "stop": ["."]}
    assert all(type(plain[k]) in (int, float) for k in ("max_tokens", "seed", "temperature"))
    request = parse_request({"prompt": "x", **plain}, chat=False)
    assert (request.max_tokens, request.seed) == (5, 3)


def test_other_values_stay_as_they_are_and_wrong_types_are_refused() -> None:
    array = np.array([1, 2])
    assert _plain({"logit_bias": {"1": 2.0}, "x": array})["x"] is array  # not a scalar: untouched
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request({"prompt": "x", **_plain({"max_tokens": "5"})}, chat=False)
