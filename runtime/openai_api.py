"""The OpenAI wire format a worker speaks: request models, validation, responses, SSE chunks.

Kept apart from the worker's lifecycle so the SDK (``context.model``) and the HTTP routes
share one definition of what a valid request is and how a completion is reported.

No request field is silently ignored. A field is accepted only when Ember honours it or when
ignoring it cannot change the response (identifiers, prompt-cache hints; see
:class:`SamplingFields`). OpenAI fields Ember does not implement (``n`` other than 1,
``logprobs``, ``reasoning_effort``, ``store: true``, ...: :data:`UNSUPPORTED`)
are answered 400 naming the field, unless they carry the value that means "not used"; any
other key is answered 400 as unrecognized, as OpenAI does. The same holds for the keys of a
chat message. ``max_completion_tokens`` is ``max_tokens`` under its newer name (it wins when
both are given). A request's ``max_tokens`` is clamped to the function's ``maxTokens``.
``stream_options.include_usage`` adds OpenAI's final usage chunk to a stream.
``ignore_eos`` (a vLLM extension, also llama.cpp's) keeps decoding past the model's end-of-text
token until ``max_tokens`` or a stop string: benchmarks use it to decode a fixed token count.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    ValidationError,
    model_validator,
)

from runtime.engine.engine import StepOutput
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import RequestFailed
from runtime.openai_tools import ResponseFormat, Tool, ToolChoice

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy
# A prompt longer than this many characters per context token cannot fit (no tokenizer packs
# more than a few characters in a token): rejected before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


def _is_default(*defaults: object) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == d and type(value) is type(d) for d in defaults)


def _is_empty(value: Any) -> bool:
    return value is None or value in ([], {})


# OpenAI request fields (chat and legacy completions) Ember does not implement, with the
# values that mean "not used"; any other value is a 400 naming the field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": _is_default(1),
    "best_of": _is_default(1),
    "logprobs": _is_default(False),
    "top_logprobs": _is_default(0),
    "echo": _is_default(False),
    "suffix": _is_default(""),
    "logit_bias": _is_empty,
    "functions": _is_empty,
    "function_call": _is_default("none"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is_default(),
    "prediction": _is_default(),
    "reasoning_effort": _is_default(),  # Ember's models do not reason in hidden tokens
    "verbosity": _is_default(),
    "web_search_options": _is_default(),
    "moderation": _is_default(),
    "store": _is_default(False),  # nothing is stored for later retrieval or evals
    # One processing tier: a client asking for flex, priority or scale expects its latency
    # or price terms, which Ember cannot give.
    "service_tier": _is_default("auto", "default"),
}

# Keys of a chat message Ember does not implement, with their "not used" values. A message
# ``name`` is not passed to chat templates, so it would be silently dropped: refused. The
# others appear when a client replays an assistant message it received.
UNSUPPORTED_IN_MESSAGE: dict[str, Callable[[Any], bool]] = {
    "name": _is_default(),
    "function_call": _is_default(),
    "refusal": _is_default(),
    "audio": _is_default(),
}


class RequestError(Exception):
    """A client mistake: answered with HTTP 400 and an OpenAI-style error body."""


def _unicode(text: str) -> str:
    """``text`` if the tokenizer can take it: JSON's ``\\ud800`` escapes can carry lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"a lone surrogate at position {exc.start} is not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
# An identifier Ember accepts and ignores (it cannot change a response); bounded like OpenAI's.
Identifier = Annotated[str, StringConstraints(max_length=512)]
MetadataKey = Annotated[str, StringConstraints(max_length=64)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None  # None: an assistant turn that only called tools
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=128)  # runtime.openai_tools
    tool_call_id: Identifier | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False  # honoured: a last chunk with no choices and the usage
    # Obfuscation pads stream events against length side channels. Ember does not pad (as
    # if false were sent), so a client asking for it is refused rather than left unprotected.
    include_obfuscation: StrictBool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # newer name of max_tokens; wins
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension (llama.cpp's server takes it too): decode past end-of-text, so a
    # benchmark can ask every server for the same number of tokens.
    ignore_eos: StrictBool = False
    # Accepted and ignored: ignoring them cannot change the response. End-user identifiers
    # (OpenAI's abuse monitoring), labels for stored completions, prompt-cache hints (a cache
    # changes latency, never tokens). parallel_tool_calls is honoured by runtime.openai_tools.
    user: Identifier | None = None
    safety_identifier: Identifier | None = None
    metadata: dict[MetadataKey, Identifier] | None = Field(None, max_length=16)
    prompt_cache_key: Identifier | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _alias(self) -> SamplingFields:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with OpenAI's usage chunk (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Structured outputs and tools: runtime.openai_tools (constrained by runtime.structured).
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: ToolChoice | None = None


class CompletionRequest(SamplingFields):
    prompt: Text


def _without_unused(body: Mapping[str, Any], table: Mapping[str, Callable[[Any], bool]], where: str) -> Any:
    """``body`` less the keys of ``table`` that carry their "not used" value; :class:`RequestError`
    naming the first that does not."""
    for name, unused in table.items():
        if name in body and not unused(body[name]):
            raise RequestError(f"{where}{name}: Ember does not implement this field")
    return {k: v for k, v in body.items() if k not in table}


def parse_request(body: Any, chat: bool) -> ChatRequest | CompletionRequest:
    """Validate a request body; :class:`RequestError` names the first bad field (a field Ember
    does not implement, or one it does not recognize)."""
    if isinstance(body, dict):
        body = _without_unused(body, UNSUPPORTED, "")
        messages = body.get("messages")
        if isinstance(messages, list):
            body["messages"] = [
                _without_unused(m, UNSUPPORTED_IN_MESSAGE, f"messages.{i}.") if isinstance(m, dict) else m
                for i, m in enumerate(messages)
            ]
    try:
        request = ChatRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(body)"
        if first["type"] == "extra_forbidden":
            raise RequestError(f"{where}: unrecognized request field") from None
        raise RequestError(f"{where}: {first['msg']}") from None
    options = request.stream_options
    if options is not None:
        if not request.stream:  # as OpenAI answers
            raise RequestError("stream_options: only allowed when stream is true")
        if options.include_obfuscation:
            raise RequestError("stream_options.include_obfuscation: Ember does not implement this field")
    return request


def check_prompt_chars(chars: int, max_context: int) -> None:
    """:class:`RequestError` for a prompt of ``chars`` characters that cannot fit a context of
    ``max_context`` tokens whatever it tokenizes to (checked before tokenizing it)."""
    if chars > max_context * MAX_CHARS_PER_TOKEN:
        raise RequestError(
            f"the prompt has {chars} characters, far more than fit the model's context of "
            f"{max_context} tokens"
        )


def sampling_params(
    request: SamplingFields, prompt_len: int, max_context: int, default_max: int
) -> SamplingParams:
    """Sampling parameters for a prompt of ``prompt_len`` tokens, or :class:`RequestError`.

    ``default_max`` is the function's ``maxTokens``: the default and the cap of ``max_tokens``
    (a request asking for more than the context holds is still an error).
    """
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    if prompt_len >= max_context:
        raise RequestError(
            f"the prompt has {prompt_len} tokens and leaves no room in the model's context of "
            f"{max_context} tokens"
        )
    max_tokens = request.max_tokens or min(default_max, max_context - prompt_len)
    if max_tokens < 1 or prompt_len + max_tokens > max_context:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; with max_tokens={max_tokens} it exceeds the model's "
            f"context of {max_context} tokens"
        )
    max_tokens = min(max_tokens, default_max)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            # Dividing float32 logits by a vanishing temperature overflows them (NaN probabilities):
            # such a temperature is greedy decoding in all but name.
            temperature=request.temperature if request.temperature >= MIN_TEMPERATURE else 0.0,
            top_p=request.top_p,
            seed=request.seed,
            stop=stop,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            ignore_eos=request.ignore_eos,
        )
    except ValueError as exc:
        raise RequestError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished completion (what ``context.model`` returns to a handler)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(rid: str, model: str, chat: bool, done: Completion) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` / ``text_completion`` response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_body(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
    }


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON (or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def sse_chunks(
    stream: AsyncIterator[StepOutput],
    rid: str,
    model: str,
    chat: bool,
    prompt_tokens: int,
    include_usage: bool = False,
) -> AsyncIterator[bytes]:
    """OpenAI streaming chunks for one request, then ``[DONE]``.

    The chunk with the finish reason carries ``usage`` (an Ember extension clients have
    relied on). With ``include_usage`` (``stream_options.include_usage``) it is OpenAI's
    form instead: every chunk has ``"usage": null`` and one last chunk, with no choices,
    carries the usage. A stream that fails ends with one error event and no usage.
    """
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = 0
    cached = 0

    def usage() -> dict[str, Any]:
        return usage_body(prompt_tokens, n, cached)

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model}
        body["choices"] = choices
        if usage is not None or include_usage:
            body["usage"] = usage
        return sse_event(body)

    def chunk(delta: str | None, reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = {"content": delta} if delta is not None else {"role": "assistant"}
        else:
            choice["text"] = delta or ""
        return event([choice], usage() if reason and not include_usage else None)

    if chat:
        yield chunk(None, None)
    try:
        async for out in stream:
            n += 1
            cached = out.cached_tokens
            reason = out.finish_reason.value if out.finish_reason else None
            if out.text_delta or reason:
                yield chunk(out.text_delta, reason)
    except RequestFailed as exc:  # one error event, as OpenAI streams do
        yield sse_event({"error": {"type": exc.code, "message": str(exc)}})
    else:
        if include_usage:
            yield event([], usage())
    yield sse_event("[DONE]")
