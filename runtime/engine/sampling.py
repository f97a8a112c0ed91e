"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, min-p, penalties,
logit bias, min-tokens, seed) and token log-probabilities.

The order is vLLM's: logit bias and the min-tokens end-of-text mask, then the penalties
(repetition, presence, frequency), then temperature and the top-k, top-p and min-p cuts.
Every step but the argmax runs only when its parameter is set, so the default greedy
request costs one ``argmax``. Log-probabilities (:func:`token_logprob`) are those of the
model's own distribution, before any of these adjustments (vLLM's default, "raw"
logprobs): they say how likely the model found a token, whatever the sampler then did.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI accepts a few hundred)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy.

    ``logit_bias`` pairs a token id with a bias added to its logit (-100 bans it, 100 all but
    forces it); ``min_tokens`` keeps end-of-text and stop strings from ending the output
    before that many tokens; ``repetition_penalty`` (> 1 discourages) divides positive and
    multiplies negative logits of every token in the prompt or output (CTRL's, vLLM's form);
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely one.
    ``logprobs`` is the number of alternatives reported with each sampled token's
    log-probability (None: no log-probabilities); ``prompt_logprobs`` the same for every
    prompt token after the first (completions' ``echo``).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (0.0 <= self.temperature <= 10.0) or math.isnan(self.temperature):
            raise ValueError("temperature must be in [0, 10]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has more than {MAX_LOGIT_BIAS} entries")
        if any(token < 0 or not -100.0 <= bias <= 100.0 for token, bias in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and the ``k`` most likely tokens at its place, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` (vocab,) with the top ``k`` alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(logp, min(k, logp.numel()))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), top)


def targets_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Per row of ``logits`` (len(targets), vocab), the log-probability of ``targets[row]`` with
    the top ``k`` alternatives (a prompt's tokens, each given the tokens before it)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].tolist()
    if not k:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen, strict=True)]
    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(ix, vs, strict=True)))
        for t, lp, vs, ix in zip(targets, chosen, values.tolist(), ids.tolist(), strict=True)
    ]


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    eos_ids: Collection[int] = (),
) -> torch.Tensor:
    """``logits`` (vocab,) after logit bias, the min-tokens mask and the penalties (a new
    tensor when any applies; ``logits`` itself otherwise)."""
    if params.logit_bias:
        logits = logits.clone()
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        logits[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype)
    if eos_ids and not params.ignore_eos and len(output_ids) < params.min_tokens:
        logits = logits.clone()
        logits[torch.tensor(sorted(eos_ids), dtype=torch.long)] = -math.inf
    if params.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(prompt_ids + output_ids, dtype=torch.long))
        logits = logits.clone()
        picked = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.unique(torch.tensor(output_ids), return_counts=True)
        logits = logits.clone()
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    output_ids: list[int],
    generator: torch.Generator | None,
    prompt_ids: list[int] | None = None,
    eos_ids: Collection[int] = (),
) -> int:
    """One token from ``logits`` (vocab,) float32 under ``params``."""
    logits = process_logits(logits, params, prompt_ids or [], output_ids, eos_ids)
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)  # keeps the top token
    return int(torch.multinomial(probs, 1, generator=generator))
