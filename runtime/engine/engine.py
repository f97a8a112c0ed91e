"""The engine facade: add requests, ``step()`` one iteration, stream text deltas."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from runtime.engine.block_manager import BaseBlockSource, BlockManager
from runtime.engine.detokenize import Detokenizer, special_ids
from runtime.engine.model_runner import ModelRunner
from runtime.engine.sampling import SamplingParams, TokenLogprob
from runtime.engine.scheduler import (
    EngineError,
    KVCacheExhausted,
    Scheduler,
    SchedulerConfig,
    SloUnattainable,
)
from runtime.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenConstraint
from runtime.mesh.gate import Gate
from runtime.mesh.slo import RequestClock, Slo
from runtime.mesh.state_page import MAX_SLOWDOWN, MIN_SLOWDOWN, Entry
from runtime.mesh.time_table import TimeTable
from runtime.mesh.watermark import Watermark
from runtime.models.llama import LlamaModel

log = logging.getLogger("ember.engine")
SLOWDOWN_WEIGHT = 0.2  # of the newest step in the slowdown's moving average
ADMIT_RETRY_S = 0.05  # a refused request asks the shadow validation again after this, then
ADMIT_RETRY_MAX_S = 0.4  # twice as long each time up to this (the agent validates every ask)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    refill_blocks: int = 8  # blocks fetched from the pool per refill of the local free list
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefix_caching: bool = True  # reuse full KV blocks of a shared prompt prefix (block_manager)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.refill_blocks < 1:
            raise ValueError("block_size and refill_blocks must be >= 1")


class HangUp:
    """A request's client going away, for the streams of its choices: :meth:`__call__` stops
    each one's sequence now. (A server that stops iterating a stream does not always close
    it, and only a closed or ended stream aborts its sequence: until then the engine went on
    decoding to ``max_tokens`` for nobody.)"""

    def __init__(self) -> None:
        self.happened = False
        self._watched: list[tuple[Engine, int]] = []

    def watch(self, engine: Engine, seq_id: int) -> None:
        self._watched.append((engine, seq_id))

    def __call__(self) -> None:
        self.happened = True
        for engine, seq_id in self._watched:
            engine.hang_up(seq_id)


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one sequence."""

    seq_id: int
    token_id: int | None  # None when the request failed before producing a token
    text_delta: str
    finish_reason: FinishReason | None
    error: str | None = None
    error_code: str | None = None  # "kv_cache_exhausted" or "engine_error" with FinishReason.ERROR
    cached_tokens: int = 0  # prompt tokens whose KV was reused (usage.prompt_tokens_details)
    logprob: TokenLogprob | None = None  # the token's, when its request asked (params.logprobs)
    # On a request's first output, when it asked (params.prompt_logprobs): one per prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class _TextState:
    detokenizer: Detokenizer
    emitted: str = ""  # text already handed out (stop strings and partial UTF-8 held back)


class Engine:
    """One model, one KV store, many concurrent sequences."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        kv_blocks: object,
        source: BaseBlockSource,
        eos_ids: set[int],
        config: EngineConfig | None = None,
        model_key: str = "",
    ) -> None:
        """``model_key`` names the model and its KV layout: it seeds the prefix-cache block
        hashes, so KV is only ever reused by the model (and layout) that computed it."""
        import torch

        assert isinstance(kv_blocks, torch.Tensor)
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.blocks = BlockManager(
            source,
            self.config.block_size,
            self.config.refill_blocks,
            model_key=model_key,
            prefix_caching=self.config.prefix_caching,
        )
        self.scheduler = Scheduler(self.config.scheduler, self.blocks)
        self.runner = ModelRunner(model, kv_blocks, self.config.block_size, eos_ids)
        self.max_context = model.config.max_position_embeddings
        self.seqs: dict[int, Sequence] = {}
        self._text: dict[int, _TextState] = {}
        self._special_ids = special_ids(tokenizer)  # left out of detokenization windows
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[StepOutput]] = {}
        self._work = asyncio.Event()  # set by add_request: wakes an idle run_forever
        # Token-level scheduling of the device (runtime.mesh): run_forever steps only with a grant.
        self.gate: Gate | None = None
        self.ended: str | None = None  # why it takes no more requests (end), if it does not
        self.slo = Slo()
        self.table: TimeTable | None = None
        self.slowdown = 1.0  # measured step time / the table's (EWMA): see schedule_with
        self._step_shape: tuple[bool, int, int, float] | None = None  # (prefill, tokens, batch, avg len)
        self.avg_out = 0.0  # output tokens of finished requests: a running mean (LLM-Mesh's O-bar)
        # KV blocks held beyond the running requests' (scale_kv; bytes_per_token 1: in tokens).
        self.watermark = Watermark(
            bytes_per_token=1, w=0.2, min_tokens=self.config.block_size * self.config.refill_blocks
        )
        self._num_finished = 0
        # Sequences admitted by the token scheduler and not added yet (the other choices of an
        # n > 1 request still asking): published with the rest, so each is validated with them.
        self._admitted: list[Entry] = []

    def schedule_with(self, gate: Gate, slo: Slo, table: TimeTable | None = None) -> None:
        """Step only when ``gate`` grants the device, asking with the deadline (LLM-Mesh Eq. 1,
        under ``slo``) of the most urgent unfinished request (see :meth:`urgency`). ``table``:
        the model's time table; each step's measured time against it is the slowdown the state
        page reports, so the agent's admissions follow what the device delivers now."""
        self.gate, self.slo, self.table = gate, slo, table

    def _calibrate(self, seconds: float) -> None:
        """Fold one step's measured ``seconds`` into :attr:`slowdown` (EWMA, bounded)."""
        shape, self._step_shape = self._step_shape, None
        if self.table is None or shape is None or seconds <= 0:
            return
        prefill, tokens, batch, avg_len = shape
        expected = self.table.prefill(tokens) if prefill else self.table.decode(batch, avg_len)
        if expected > 0:
            ratio = min(max(seconds / expected, MIN_SLOWDOWN), MAX_SLOWDOWN)
            self.slowdown += SLOWDOWN_WEIGHT * (ratio - self.slowdown)

    async def admit(self, prompt_tokens: int, n: int = 1) -> float:
        """Wait until the token scheduler's shadow validation admits ``n`` sequences of
        ``prompt_tokens`` (at once without a gate); returns the arrival time their SLO counts
        from. :class:`SloUnattainable` once the first token could no longer come in time."""
        arrival = time.monotonic()
        gate = self.gate
        if gate is None:
            return arrival
        due = arrival + self.slo.ttft_for(prompt_tokens)
        admitted: list[Entry] = []
        try:
            for _ in range(n):
                pause = ADMIT_RETRY_S
                while (case := await gate.admit(prompt_tokens)) != 0:
                    if time.monotonic() + pause > due:
                        raise SloUnattainable(
                            f"the device cannot start {prompt_tokens} prompt tokens within the "
                            f"{self.slo.ttft_for(prompt_tokens):g} s TTFT SLO without missing an SLO "
                            f"(shadow validation case {case}); retry later"
                        )
                    await asyncio.sleep(pause)  # requests finish meanwhile: ask again, less often
                    pause = min(2 * pause, ADMIT_RETRY_MAX_S)
                admitted.append(Entry(arrival, prompt_tokens, 0))
                self._admitted.append(admitted[-1])
                self.publish_state()  # the next choice is validated with this one
        except (OSError, ValueError) as exc:  # GateClosed, WireError: the agent is gone
            log.error("token scheduling ends, the instance runs on its own: %s", exc)
            self.gate = None
        finally:  # added by the caller now (or refused): no longer counted twice
            for entry in admitted:
                self._admitted.remove(entry)
            if admitted:
                self.publish_state()
        return arrival

    def publish_state(self) -> None:
        """Write the unfinished requests into the gate's state page (the agent's admissions
        read it: runtime.mesh.state_page)."""
        page = self.gate.page if self.gate is not None else None
        if page is None:
            return
        seqs = [*self.scheduler.waiting, *self.scheduler.running]
        entries = [Entry(s.arrival, len(s.prompt_ids), len(s.output_ids)) for s in seqs]
        page.write(self.avg_out, [*entries, *self._admitted], self.slowdown)

    def urgency(self) -> float:
        """The deadline of the most urgent unfinished request (monotonic seconds; inf: none)."""
        seqs = [*self.scheduler.waiting, *self.scheduler.running]
        clocks = (RequestClock(s.arrival, len(s.prompt_ids), self.slo, len(s.output_ids)) for s in seqs)
        return min((c.deadline() for c in clocks), default=float("inf"))

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
        arrival: float | None = None,
        adapter: str | None = None,
    ) -> int:
        """Queue a request; it joins the batch at the next step boundary. A ``constraint``
        (runtime.structured) masks its tokens to a grammar and finishes it when that completes.
        ``adapter``: the key of a LoRA adapter of the model (``LlamaModel.adapters``) it runs with."""
        if self.ended is not None:
            raise EngineError(self.ended)
        if adapter is not None and adapter not in self.runner.model.adapters:
            raise ValueError(f"the model has no adapter {adapter!r}")
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_tokens} exceeds the "
                f"context of {self.max_context} tokens"
            )
        seq = Sequence(next(self._ids), list(prompt_ids), params, constraint=constraint, adapter=adapter)
        if arrival is not None:  # admitted after waiting: its SLO counts from when it came
            seq.arrival = arrival
        self.seqs[seq.seq_id] = seq
        self._text[seq.seq_id] = _TextState(Detokenizer(self.tokenizer, self._special_ids))
        self.scheduler.add(seq)
        self.publish_state()
        self._work.set()
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One iteration: a prefill or a decode of the running batch."""
        # Blocks the previous step filled go to the pool now, after its tokens went out.
        self._publish()
        try:
            seqs, prefill = self.scheduler.schedule()
        except KVCacheExhausted as exc:
            # Fail only the request that cannot fit; everyone else keeps going.
            seq = self.scheduler.waiting.popleft()
            seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, FinishReason.ERROR, str(exc)
            failed = StepOutput(seq.seq_id, None, "", FinishReason.ERROR, str(exc), exc.code)
            self._deliver(failed)
            return [failed]
        if not seqs:
            return []
        if self.table is not None:  # what this step is, for _calibrate
            tokens = sum(s.num_uncached for s in seqs) if prefill else len(seqs)
            self._step_shape = (prefill, tokens, len(seqs), sum(len(s) for s in seqs) / len(seqs))
        try:
            sampled = self.runner.run(seqs)
        except Exception as exc:  # a bug or a broken input: fail this batch, keep the engine alive
            log.exception("engine step failed; failing its %d requests", len(seqs))
            return [self._fail(seq, f"the engine failed: {type(exc).__name__}: {exc}") for seq in seqs]
        outputs = []
        now = time.monotonic()
        for seq, (token, logprob, error) in zip(seqs, sampled, strict=True):
            if error is not None:
                outputs.append(self._fail(seq, error))
                continue
            first = not seq.output_ids
            self.blocks.commit(seq)  # before the new token: only what this pass wrote is cached
            seq.output_ids.append(token)
            if seq.first_token_at is None:
                seq.first_token_at = now
            complete = False
            if seq.constraint is not None:
                if not seq.constraint.accept(token):  # the mask forbids this: a bug, not the client's
                    outputs.append(self._fail(seq, f"token {token} broke the output grammar"))
                    continue
                complete = seq.constraint.terminated
            delta, reason = self._advance_text(seq, token, complete)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                self.runner.forget(seq)
                self._num_finished += 1  # a mean over the last ~100 finished requests
                self.avg_out += (len(seq.output_ids) - self.avg_out) / min(self._num_finished, 100)
            out = StepOutput(seq.seq_id, token, delta, reason, cached_tokens=seq.cached_tokens or 0)
            out.logprob = logprob
            if first:
                out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
            self._deliver(outputs[-1])
        return outputs

    def _fail(self, seq: Sequence, message: str) -> StepOutput:
        seq.finish_reason, seq.error = FinishReason.ERROR, message
        self.scheduler.drop(seq)
        self.runner.forget(seq)
        out = StepOutput(seq.seq_id, None, "", FinishReason.ERROR, message, "engine_error")
        self._deliver(out)
        return out

    def end(self, message: str) -> None:
        """Fail every request and refuse new ones (:class:`EngineError` with ``message``): the
        instance ended under the engine (its pool died). Its KV blocks are not given back: they
        went with the pool."""
        self.ended = message
        self.fail_all(message)

    def fail_all(self, message: str) -> None:
        """End every unfinished request the engine holds with an error (each stream gets
        ``message``), wherever a failed step left it."""
        for seq in list(self.seqs.values()):
            if seq.status is not SequenceStatus.FINISHED:
                self._fail(seq, message)

    def _deliver(self, out: StepOutput) -> None:
        queue = self._queues.get(out.seq_id)
        if queue is not None:
            queue.put_nowait(out)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, adapters: list[str | None] | None = None
    ) -> list[Sequence]:
        """Run requests to completion (all admitted at once); the finished sequences.
        ``adapters``: one LoRA adapter key (or None) per prompt."""
        chosen = adapters if adapters is not None else [None] * len(prompts)
        ids = [self.add_request(p, params, adapter=a) for p, a in zip(prompts, chosen, strict=True)]
        while self.has_unfinished():
            self.step()
        self._publish()
        return [self.seqs[i] for i in ids]

    def scale_kv(self) -> None:
        """Watermark KV scaling (LLM-Mesh §6.2, Eq. 2) of the unused blocks this engine holds:
        short of what its requests are expected to need (prompts plus the average output
        length), it fetches up to that plus the watermark at once; above it by more than the
        watermark twice, it returns the surplus to the pool for its neighbours. Blocks of
        the prefix cache are kept either way."""
        blocks = self.blocks
        current, target = self._kv_scaling()
        if target is None:
            return
        try:
            if target > current:
                blocks.reserve(target - current)  # refused: the steps allocate on demand
            else:
                blocks.trim_free(max(0, target - blocks.num_held))
        except Exception:  # the pool's trouble: costs only the scaling (a step finds out)
            log.exception("scaling the KV blocks failed")

    def kv_prefetch(self) -> int:
        """The blocks :meth:`scale_kv` would fetch now (0: none): a new instance asks the pool
        for them with its weights, in one round trip (:meth:`adopt_kv`)."""
        current, target = self._kv_scaling()
        return 0 if target is None else max(0, target - current)

    def adopt_kv(self, block_ids: list[int], prefix_hashes: tuple[bytes, ...] = ()) -> None:
        """Hold ``block_ids`` (the source's numbers of blocks fetched for this engine, see
        :meth:`kv_prefetch`) as unused blocks, as :meth:`scale_kv` would have. The first
        ``len(prefix_hashes)`` came filled with prefix KV of those hashes: they are held as
        cached blocks (:meth:`BlockManager.adopt_prefix`)."""
        num_prefix = len(prefix_hashes)
        self.blocks.adopt_prefix(block_ids[:num_prefix], list(prefix_hashes))
        self.blocks.free.extend(block_ids[num_prefix:])

    def _kv_scaling(self) -> tuple[int, int | None]:
        """The blocks held now and the watermark's target (None: stay), for :meth:`scale_kv`."""
        seqs = [*self.scheduler.waiting, *self.scheduler.running]
        tokens = self.watermark.require(((len(s.prompt_ids), len(s.output_ids)) for s in seqs), self.avg_out)
        blocks = self.blocks
        require = -(-tokens // blocks.block_size) - len(blocks.evictable)  # cached blocks are reusable
        current = blocks.num_held + len(blocks.free)
        return current, self.watermark.target(current, max(require, blocks.num_held))

    def _publish(self) -> None:
        """Offer newly computed prompt blocks to the pool; a failure costs only the sharing."""
        try:
            self.blocks.flush_publish()
        except Exception:
            log.exception("publishing prefix KV blocks failed")

    def abort(self, seq_id: int) -> None:
        """Stop a request (its client went away): its blocks and batch slot are freed now."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.drop(seq)
        seq.finish_reason = FinishReason.STOP
        self.runner.forget(seq)

    def hang_up(self, seq_id: int) -> None:
        """Stop a streamed request whose client went away: abort it, and end its stream (its
        consumer gets a last, empty output instead of waiting for tokens nobody reads)."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return
        self.abort(seq_id)
        self._deliver(StepOutput(seq_id, None, "", FinishReason.STOP))

    def forget(self, seq_id: int) -> None:
        """Drop a request's records (after its results were read)."""
        self.abort(seq_id)
        self.seqs.pop(seq_id, None)
        self._text.pop(seq_id, None)

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
        arrival: float | None = None,
        adapter: str | None = None,
        hang_up: HangUp | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Add a request and yield its outputs as steps produce them (someone must drive
        :meth:`step`, e.g. :meth:`run_forever`); ``arrival``: see :meth:`admit`; ``adapter``:
        see :meth:`add_request`; ``hang_up``: ends the stream early when its client goes away."""
        if hang_up is not None and hang_up.happened:
            return
        seq_id = self.add_request(prompt_ids, params, constraint, arrival, adapter)
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[seq_id] = queue
        if hang_up is not None:
            hang_up.watch(self, seq_id)
        try:
            while True:
                out = await queue.get()
                if out.finish_reason is FinishReason.ERROR:
                    kind = KVCacheExhausted if out.error_code == KVCacheExhausted.code else EngineError
                    raise kind(out.error or "the request failed")
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            self._queues.pop(seq_id, None)
            self.forget(seq_id)  # also aborts it if the consumer stopped early

    async def run_forever(self) -> None:
        """Drive :meth:`step` while the event loop runs (steps are yielded between). Idle, it
        sleeps until :meth:`add_request` wakes it (no polling: idle instances burn no CPU).

        An error escaping a step (scheduling bookkeeping, not the model: :meth:`step` fails
        those requests itself) fails every request in the engine; the loop keeps serving.
        """
        while True:
            if self.has_unfinished():
                gate = self.gate
                if gate is not None:
                    try:
                        await gate.acquire(self.urgency())
                    except (OSError, ValueError) as exc:  # the agent is gone: run unscheduled
                        log.error("token scheduling ends, the instance runs on its own: %s", exc)
                        self.gate = gate = None
                try:
                    t0 = time.perf_counter()
                    self.step()
                    self._calibrate(time.perf_counter() - t0)
                except Exception as exc:
                    log.exception("engine step failed; failing every request")
                    self.fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
                finally:
                    if gate is not None:
                        self.publish_state()
                        self._release(gate)
                        self.scale_kv()  # co-located: unused KV goes back to the neighbours
                await asyncio.sleep(0)
            else:
                if self.gate is not None:
                    self._release(self.gate, idle=True)
                    self.scale_kv()
                self._publish()
                self._work.clear()
                await self._work.wait()

    def _release(self, gate: Gate, idle: bool = False) -> None:
        try:
            gate.idle() if idle else gate.release()
        except (OSError, ValueError) as exc:
            log.error("token scheduling ends, the instance runs on its own: %s", exc)
            self.gate = None

    def text(self, seq_id: int) -> str:
        """Text emitted so far for a sequence."""
        return self._text[seq_id].emitted

    def close(self) -> None:
        """Return every KV block to its source."""
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
        self.scheduler.waiting.clear()
        self._publish()
        self.blocks.trim(0)

    def _advance_text(
        self, seq: Sequence, token: int, complete: bool = False
    ) -> tuple[str, FinishReason | None]:
        """The text delta of ``token`` and the finish reason; ``complete``: the output grammar
        allows nothing more (the sequence stops with all its text)."""
        state = self._text[seq.seq_id]
        params = seq.params
        eos = token in self.eos_ids and not params.ignore_eos
        ids = seq.output_ids[:-1] if eos else seq.output_ids
        reason: FinishReason | None = FinishReason.STOP if eos or complete else None
        at_limit = len(seq.output_ids) >= params.max_tokens
        full = state.detokenizer.decoded(ids, final=reason is not None or at_limit)  # new ids decoded only
        # Before min_tokens no stop string ends the output (vLLM's rule), so none is looked for
        # or held back: one completed earlier is plain text.
        stops = params.stop if len(seq.output_ids) >= params.min_tokens else ()
        hits = [full.find(stop, max(0, len(state.emitted) - len(stop) + 1)) for stop in stops]
        if any(at >= 0 for at in hits):  # the earliest stop string wins, whatever its place in the list
            full, reason = full[: min(at for at in hits if at >= 0)], FinishReason.STOP
        if reason is None and at_limit:
            reason = FinishReason.LENGTH
        if reason is None:  # a partial UTF-8 character is held back already (not final)
            # Hold back any tail that may start a stop string.
            hold = max((len(s) - 1 for s in stops), default=0)
            if hold:
                full = full[: max(len(state.emitted), len(full) - hold)]
        delta = full[len(state.emitted) :] if full.startswith(state.emitted) else ""
        state.emitted += delta
        return delta, reason
