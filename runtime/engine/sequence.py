"""Request state: one sequence of tokens being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.engine.sampling import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"  # the request could not run (e.g. it needs more KV blocks than can be had)


class TokenConstraint(Protocol):
    """A per-sequence output grammar (runtime.structured.Constraint): masks the logits before
    sampling, advances on the sampled token, and says when the output is complete."""

    def mask_logits(self, logits: Any) -> None: ...

    def accept(self, token: int) -> bool: ...

    @property
    def terminated(self) -> bool: ...


@dataclass(slots=True)
class Sequence:
    """Prompt plus generated tokens, its KV block table and its progress."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # physical block numbers
    num_cached: int = 0  # tokens whose K/V are in the blocks
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of token_ids, in order
    num_registered: int = 0  # leading blocks of block_table already offered to the prefix cache
    cached_tokens: int | None = None  # prompt tokens reused at first admission (OpenAI usage)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_at: float | None = None
    error: str | None = None
    # Per prompt token (None for the first), once computed: only when params.prompt_logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    constraint: TokenConstraint | None = None  # constrained decoding (response_format, tools)
    adapter: str | None = None  # key of the LoRA adapter it runs with (LlamaModel.adapters); None: base

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens the next forward pass must feed (the whole context after a preemption)."""
        return len(self) - self.num_cached
