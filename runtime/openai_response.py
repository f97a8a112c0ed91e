"""The OpenAI wire format a worker answers: completions (with ``n`` choices and
log-probabilities), their JSON bodies and their SSE chunks.

Log-probabilities are the model's own (before temperature, penalties and biases: see
:mod:`runtime.engine.sampling`), for every generated token but an end-of-text token that
ended the output (its text is not in the output either). A chat response reports them as
``choices[i].logprobs.content`` (``token``, ``logprob``, ``bytes``, ``top_logprobs``); a
legacy completion as ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob) and
``text_offset``, with the prompt's tokens first under ``echo`` (the first one's logprob is
null: nothing predicts it). Streamed, a chunk carries the logprobs of the tokens whose text
it carries.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.engine import StepOutput
from runtime.engine.sampling import TokenLogprob
from runtime.engine.scheduler import RequestFailed
from runtime.errors import error_body
from runtime.token_text import TokenText


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability (None: the first prompt token, which nothing predicts),
    with its text, exact bytes and the most likely tokens at its place."""

    token: str
    token_id: int
    bytes: bytes
    logprob: float | None
    top_logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    """One of a request's ``n`` independent completions."""

    index: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple[Logprob, ...] | None = None  # when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished completion (what ``context.model`` returns to a handler).

    ``text``, ``finish_reason`` and ``logprobs`` are the first choice's; ``choices`` has all
    ``n``; ``completion_tokens`` counts the tokens of every choice (OpenAI's usage).
    ``prompt_logprobs`` (completions with ``echo`` and ``logprobs``) has one entry per prompt
    token.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    choices: tuple[Choice, ...] = ()
    prompt_logprobs: tuple[Logprob, ...] | None = None

    @property
    def logprobs(self) -> tuple[Logprob, ...] | None:
        return self.choices[0].logprobs if self.choices else None


class Reporter:
    """Turns engine outputs into :class:`Logprob` entries (token text from the tokenizer)."""

    def __init__(self, tokens: TokenText, eos_ids: Collection[int], ignore_eos: bool) -> None:
        self.tokens = tokens
        self.eos_ids = eos_ids
        self.ignore_eos = ignore_eos

    def entry(self, lp: TokenLogprob | None, token_id: int) -> Logprob:
        top = tuple(self.entry(TokenLogprob(t, v), t) for t, v in lp.top) if lp is not None else ()
        raw = self.tokens.bytes_of(token_id)
        return Logprob(raw.decode("utf-8", "replace"), token_id, raw, lp.logprob if lp else None, top)

    def of_output(self, out: StepOutput) -> Logprob | None:
        """The entry of an output's token, None when it has none or it ended the output (EOS)."""
        if out.logprob is None or out.token_id is None:
            return None
        if out.finish_reason is not None and out.token_id in self.eos_ids and not self.ignore_eos:
            return None
        return self.entry(out.logprob, out.token_id)

    def of_prompt(self, prompt_ids: list[int], lps: list[TokenLogprob | None]) -> tuple[Logprob, ...]:
        return tuple(self.entry(lp, t) for t, lp in zip(prompt_ids, lps, strict=True))


@dataclass
class ChoiceState:
    """A choice being collected from its outputs."""

    index: int
    text: str = ""
    tokens: int = 0
    reason: str | None = None
    logprobs: list[Logprob] | None = None
    cached: int = 0
    prompt_logprobs: tuple[Logprob, ...] | None = None
    pending: list[Logprob] = field(default_factory=list)  # streamed: not yet sent with text

    def add(self, out: StepOutput, reporter: Reporter | None, prompt_ids: list[int]) -> None:
        self.text += out.text_delta
        self.tokens += 1
        self.cached = out.cached_tokens
        self.reason = out.finish_reason.value if out.finish_reason else None
        if reporter is not None:
            entry = reporter.of_output(out)
            if self.logprobs is None:
                self.logprobs = []
            if entry is not None:
                self.logprobs.append(entry)
                self.pending.append(entry)
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = reporter.of_prompt(prompt_ids, out.prompt_logprobs)

    def choice(self) -> Choice:
        lps = tuple(self.logprobs) if self.logprobs is not None else None
        return Choice(self.index, self.text, self.reason, self.tokens, lps)


def completion(states: list[ChoiceState], prompt_tokens: int) -> Completion:
    choices = tuple(s.choice() for s in states)
    first = choices[0]
    return Completion(
        first.text,
        prompt_tokens,
        sum(c.completion_tokens for c in choices),
        first.finish_reason,
        states[0].cached,
        choices,
        states[0].prompt_logprobs,
    )


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _chat_logprob(e: Logprob) -> dict[str, Any]:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}


def chat_logprobs(entries: list[Logprob] | tuple[Logprob, ...]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object."""
    content = [
        {**_chat_logprob(e), "top_logprobs": [_chat_logprob(t) for t in e.top_logprobs]} for e in entries
    ]
    return {"content": content, "refusal": None}


def text_logprobs(entries: list[Logprob] | tuple[Logprob, ...], offset: int) -> dict[str, Any]:
    """A legacy completion choice's ``logprobs`` object; ``offset``: the first token's place in
    the choice's text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {t.token: t.logprob for t in e.top_logprobs} if e.logprob is not None else None for e in entries
        ],
        "text_offset": offsets,
    }


def completion_body(
    rid: str, model: str, chat: bool, done: Completion, echo: str | None = None
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` / ``text_completion`` response (``echo``: the prompt
    text a completion's text starts with)."""
    choices = done.choices or (Choice(0, done.text, done.finish_reason, done.completion_tokens),)
    out = []
    for c in choices:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = chat_logprobs(c.logprobs) if c.logprobs is not None else None
        else:
            choice["text"] = (echo or "") + c.text
            lps = c.logprobs
            if lps is not None and echo is not None and done.prompt_logprobs is not None:
                lps = done.prompt_logprobs + lps
            choice["logprobs"] = text_logprobs(lps, 0) if lps is not None else None
        out.append(choice)
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage_body(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
    }


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON (or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def merge(streams: list[AsyncIterator[StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """The outputs of ``streams`` as they come, tagged with the stream's index; the first
    failure is raised (the other streams are then closed, aborting their requests)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:  # closed early (the client went away): the request is aborted now, not at GC
            close = getattr(streams[0], "aclose", None)
            if close is not None:
                await close()
        return
    queue: asyncio.Queue[tuple[int, StepOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StepOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except RequestFailed as exc:
            queue.put_nowait((i, None, exc))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, got, exc = await queue.get()
            if exc is not None:
                raise exc
            if got is None:
                left -= 1
            else:
                yield i, got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(
    streams: list[AsyncIterator[StepOutput]], prompt_ids: list[int], reporter: Reporter | None
) -> Completion:
    """Run ``streams`` (one per choice) to completion."""
    states = [ChoiceState(i) for i in range(len(streams))]
    async for i, out in merge(streams):
        states[i].add(out, reporter, prompt_ids)
    return completion(states, len(prompt_ids))


async def sse_chunks(
    streams: list[AsyncIterator[StepOutput]],
    rid: str,
    model: str,
    chat: bool,
    prompt_ids: list[int],
    include_usage: bool = False,
    reporter: Reporter | None = None,
    echo: str | None = None,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """OpenAI streaming chunks for one request (one stream per choice), then ``[DONE]``.

    The chunk with a choice's finish reason carries ``usage`` (an Ember extension clients
    have relied on; with ``n`` > 1, the usage of the choices finished so far). With
    ``include_usage`` (``stream_options.include_usage``) it is OpenAI's form instead: every
    chunk has ``"usage": null`` and one last chunk, with no choices, carries the usage of all
    choices; ``continuous_usage`` (vLLM's ``continuous_usage_stats``) puts the usage so far
    on every chunk as well. With ``echo`` (completions) each choice's first chunk is the
    prompt text. A stream that fails ends with one error event and no usage.
    """
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    states = [ChoiceState(i) for i in range(len(streams))]
    offsets = [0] * len(streams)
    # Only the first choice computes the prompt's logprobs (choice_params); every echo shows them.
    prompt_lps: tuple[Logprob, ...] = ()

    def usage() -> dict[str, Any]:
        return usage_body(len(prompt_ids), sum(s.tokens for s in states), states[0].cached)

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model}
        body["choices"] = choices
        if usage is not None or include_usage:
            body["usage"] = usage
        return sse_event(body)

    def chunk(i: int, delta: str | None, reason: str | None, lps: list[Logprob] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": i, "finish_reason": reason}
        if chat:
            choice["delta"] = {"content": delta} if delta is not None else {"role": "assistant"}
            if reporter is not None:
                choice["logprobs"] = chat_logprobs(lps or []) if delta is not None else None
        else:
            choice["text"] = delta or ""
            if reporter is not None:
                choice["logprobs"] = text_logprobs(lps or [], offsets[i])
                offsets[i] += len(choice["text"])
        return event([choice], usage() if continuous_usage or (reason and not include_usage) else None)

    if chat:
        for i in range(len(streams)):
            yield chunk(i, None, None)
    try:
        async for i, out in merge(streams):
            state = states[i]
            state.add(out, reporter, prompt_ids)
            prompt_lps = state.prompt_logprobs or prompt_lps
            if echo is not None and state.tokens == 1:
                yield chunk(i, echo, None, list(prompt_lps) if reporter is not None else None)
            if out.text_delta or state.reason:
                lps, state.pending = state.pending, []
                yield chunk(i, out.text_delta, state.reason, lps)
    except RequestFailed as exc:  # one error event, as OpenAI streams do
        yield sse_event(error_body(exc.code, str(exc)))
    else:
        if include_usage:
            yield event([], usage())
    yield sse_event("[DONE]")
