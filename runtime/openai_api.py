"""The OpenAI wire format a worker speaks: request models, validation, responses, SSE chunks.

Kept apart from the worker's lifecycle so the SDK (``context.model``) and the HTTP routes
share one definition of what a valid request is and how a completion is reported.

OpenAI fields Ember does not implement (``n`` other than 1, ``logprobs``, ``tools``, ...) are
answered 400 naming the field rather than silently ignored; ``max_completion_tokens`` is
``max_tokens`` under its newer name (it wins when both are given). A request's ``max_tokens``
is clamped to the function's ``maxTokens``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    model_validator,
)

from runtime.engine.engine import StepOutput
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import RequestFailed

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy
# A prompt longer than this many characters per context token cannot fit (no tokenizer packs
# more than a few characters in a token): rejected before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


def _is_default(default: object) -> Callable[[Any], bool]:
    return lambda value: value is None or bool(value == default)


# OpenAI request fields Ember does not implement, with the values that mean "not used".
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": _is_default(1),
    "best_of": _is_default(1),
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": _is_default(0),
    "echo": lambda v: v is None or v is False,
    "suffix": _is_default(""),
    "logit_bias": lambda v: v is None or v == {},
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
    "tool_choice": _is_default("none"),
    "function_call": _is_default("none"),
    "parallel_tool_calls": lambda v: True,  # meaningless without tools
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is_default(None),
    "prediction": _is_default(None),
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Text


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
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

    @model_validator(mode="after")
    def _alias(self) -> SamplingFields:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: Text


def parse_request(body: Any, chat: bool) -> ChatRequest | CompletionRequest:
    """Validate a request body; :class:`RequestError` names the first bad field (or the
    first field Ember does not implement)."""
    if isinstance(body, dict):
        for name, unused in UNSUPPORTED.items():
            if name in body and not unused(body[name]):
                raise RequestError(f"{name}: Ember does not implement this field yet")
    try:
        return ChatRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(body)"
        raise RequestError(f"{where}: {first['msg']}") from None


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
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        },
    }


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON (or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def sse_chunks(
    stream: AsyncIterator[StepOutput], rid: str, model: str, chat: bool, prompt_tokens: int
) -> AsyncIterator[bytes]:
    """OpenAI streaming chunks for one request; the last carries ``usage``, then ``[DONE]``."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = 0

    def chunk(delta: str | None, reason: str | None, usage: dict[str, int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = {"content": delta} if delta is not None else {"role": "assistant"}
        else:
            choice["text"] = delta or ""
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model}
        body["choices"] = [choice]
        if usage is not None:
            body["usage"] = usage
        return sse_event(body)

    if chat:
        yield chunk(None, None)
    try:
        async for out in stream:
            n += 1
            reason = out.finish_reason.value if out.finish_reason else None
            if out.text_delta or reason:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                }
                yield chunk(out.text_delta, reason, usage if reason else None)
    except RequestFailed as exc:  # one error event, as OpenAI streams do
        yield sse_event({"error": {"type": exc.code, "message": str(exc)}})
    yield sse_event("[DONE]")
