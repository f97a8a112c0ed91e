"""Continuous batching: new requests join at step boundaries; preemption by recompute.

Each step is either a prefill of waiting sequences (as many as fit the token budget and
the KV blocks) or a decode of every running sequence. When a running sequence cannot get
a block for its next token, the most recently admitted running sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later
(prompt and generated tokens are kept, so its output is unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.engine.block_manager import BlockManager
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.errors import EmberRuntimeError


class RequestFailed(EmberRuntimeError):
    """The engine could not complete a request (``code`` says why)."""

    code = "request_failed"


class KVCacheExhausted(RequestFailed):
    """A request needs more KV blocks than can be had even with nothing else running."""

    code = "kv_cache_exhausted"


class SloUnattainable(RequestFailed):
    """The device cannot take the request without missing its SLO or its neighbours' (the
    token scheduler's shadow validation refused it until its first token was due)."""

    code = "slo_unattainable"


class EngineError(RequestFailed):
    """A step of the engine failed (a bug or a broken input); its requests fail, others go on."""

    code = "engine_error"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_batched_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_batched_tokens must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(scheduled) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if scheduled and num_tokens + seq.num_uncached > self.config.max_batched_tokens:
                break
            if not self.blocks.can_allocate(seq):
                if not self.running and not scheduled:
                    raise KVCacheExhausted(
                        f"request {seq.seq_id} needs {self.blocks.blocks_needed(len(seq))} KV blocks of "
                        f"{self.blocks.block_size} tokens and the pool cannot provide them"
                    )
                break
            self.blocks.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            num_tokens += seq.num_uncached
            scheduled.append(seq)
        if scheduled:
            self.running.extend(scheduled)
            return scheduled, True
        popped: Sequence | None = None
        try:
            while self.running:
                popped = seq = self.running.popleft()
                while not self.blocks.can_append(seq):
                    if self.running:
                        self._preempt(self.running.pop())
                    else:
                        self._preempt(seq)
                        break
                else:
                    self.blocks.append(seq)
                    scheduled.append(seq)
                popped = None
        finally:
            # A block fetch that raised (a pool that died) loses no sequence: all stay running.
            if popped is not None and popped.status is SequenceStatus.RUNNING:
                scheduled.append(popped)
            self.running.extend(scheduled)
        return scheduled, False

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.blocks.deallocate(seq)

    def drop(self, seq: Sequence) -> None:
        """Finish ``seq`` wherever it is (running, waiting, or neither) and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.deallocate(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.blocks.deallocate(seq)
        self.waiting.appendleft(seq)
