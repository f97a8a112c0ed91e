"""The sampler's logit processing as properties: logit bias, the min-tokens end-of-text mask,
the repetition penalty, min-p, and log-probabilities (issue 13)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.sampling import SamplingParams, process_logits, sample, targets_logprobs, token_logprob

VOCAB = 12
logits_st = st.lists(st.floats(-20, 20, allow_nan=False), min_size=VOCAB, max_size=VOCAB).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32)
)
bias_st = st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, allow_nan=False), max_size=VOCAB)


@settings(max_examples=200, deadline=None)
@given(logits_st, bias_st)
def test_logit_bias_adds_to_exactly_its_tokens(logits: torch.Tensor, bias: dict[int, float]) -> None:
    params = SamplingParams(logit_bias=tuple(bias.items()))
    out = process_logits(logits, params, [], [])
    for t in range(VOCAB):
        assert out[t].item() == pytest.approx(logits[t].item() + bias.get(t, 0.0), abs=1e-4)
    assert torch.equal(logits, logits.clone())  # the input is not modified


@settings(max_examples=100, deadline=None)
@given(logits_st, st.integers(0, VOCAB - 1))
def test_a_minus_100_bias_bans_and_a_plus_100_bias_forces_under_greedy(logits: torch.Tensor, t: int) -> None:
    assert sample(logits, SamplingParams(logit_bias=((t, 100.0),)), [], None) == t
    assert sample(logits, SamplingParams(logit_bias=((t, -100.0),)), [], None) != t


@settings(max_examples=100, deadline=None)
@given(logits_st, st.integers(0, 5), st.integers(0, 5), st.integers(0, 2**32))
def test_min_tokens_masks_eos_until_reached(
    logits: torch.Tensor, produced: int, minimum: int, seed: int
) -> None:
    eos = {2, 5}
    params = SamplingParams(max_tokens=8, temperature=1.0, min_tokens=minimum)
    g = torch.Generator().manual_seed(seed)
    token = sample(logits, params, [0] * produced, g, [], eos)
    if produced < minimum:
        assert token not in eos
    masked = process_logits(logits, params, [], [0] * produced, eos)
    assert all(math.isinf(masked[e].item()) for e in eos) == (produced < minimum)
    ignoring = SamplingParams(max_tokens=8, min_tokens=minimum, ignore_eos=True)
    assert torch.equal(process_logits(logits, ignoring, [], [0] * produced, eos), logits)


@settings(max_examples=100, deadline=None)
@given(logits_st, st.lists(st.integers(0, VOCAB - 1), max_size=6), st.floats(1.01, 2.0))
def test_repetition_penalty_lowers_seen_tokens_only(
    logits: torch.Tensor, seen: list[int], penalty: float
) -> None:
    out = process_logits(logits, SamplingParams(repetition_penalty=penalty), seen[:3], seen[3:])
    for t in range(VOCAB):
        if t in seen:
            assert out[t] <= logits[t]
            assert out[t] < logits[t] or abs(logits[t]) < 1e-6  # (a tiny logit may round back)
        else:
            assert out[t] == logits[t]


@settings(max_examples=200, deadline=None)
@given(logits_st, st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_min_p_never_samples_a_token_below_the_cut(logits: torch.Tensor, min_p: float, seed: int) -> None:
    params = SamplingParams(temperature=1.0, min_p=min_p)
    probs = torch.softmax(logits, -1)
    token = sample(logits, params, [], torch.Generator().manual_seed(seed))
    assert probs[token] >= min_p * probs.max() - 1e-6  # the top token always stays


@settings(max_examples=100, deadline=None)
@given(logits_st, st.integers(0, VOCAB - 1), st.integers(0, VOCAB))
def test_logprobs_are_the_raw_distribution(logits: torch.Tensor, token: int, k: int) -> None:
    lp = token_logprob(logits, token, k)
    assert lp.logprob == pytest.approx(torch.log_softmax(logits, -1)[token].item(), abs=1e-5)
    assert len(lp.top) == k
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("k", [0, 2])
def test_targets_logprobs_row_by_row(k: int) -> None:
    logits = torch.randn(4, VOCAB)
    targets = [3, 1, 4, 1]
    out = targets_logprobs(logits, targets, k)
    for row, entry in enumerate(out):
        assert entry.token_id == targets[row] and len(entry.top) == k
        assert entry == token_logprob(logits[row], targets[row], k) or entry.logprob == pytest.approx(
            token_logprob(logits[row], targets[row], k).logprob, abs=1e-5
        )


@pytest.mark.parametrize(
    "kwargs",
    [{"min_p": 1.5}, {"repetition_penalty": 0.0}, {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)},
     {"min_tokens": 9, "max_tokens": 8}, {"logprobs": 21}, {"prompt_logprobs": -1}],
)  # fmt: skip
def test_bad_parameters_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
