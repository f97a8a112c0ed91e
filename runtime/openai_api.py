"""The OpenAI wire format a worker accepts: request models, validation, sampling parameters.

Kept apart from the worker's lifecycle so the SDK (``context.model``) and the HTTP routes
share one definition of what a valid request is (responses: :mod:`runtime.openai_response`).
The README's "OpenAI API" table lists every field and what Ember does with it.

No request field is silently ignored. A field is accepted only when Ember honours it or when
ignoring it cannot change the response (identifiers, prompt-cache hints; see
:class:`SamplingFields`). OpenAI fields Ember does not implement (``best_of``, ``suffix``,
``reasoning_effort``, ``store: true``, ...: :data:`UNSUPPORTED`) are answered 400 naming the
field, unless they carry the value that means "not used"; any other key is answered 400 as
unrecognized, as OpenAI does. The same holds for the keys of a chat message and for content
parts (only ``text`` parts). ``max_completion_tokens`` is ``max_tokens`` under its newer
name (it wins when both are given); a request's ``max_tokens`` is clamped to the function's
``maxTokens``. ``n`` choices are independent sequences over one prompt; with a ``seed``,
choice ``i`` samples with seed ``seed + i`` (mod 2**64), so a request is reproducible.
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens`` and
``ignore_eos`` are taken under vLLM's names and meanings.
``response_format`` (JSON mode, JSON schema) and ``tools`` / ``tool_choice`` are
:mod:`runtime.openai_tools`' (constrained decoding: :mod:`runtime.structured`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationError,
    model_validator,
)

from runtime.engine.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from runtime.openai_tools import ResponseFormat, Tool, ToolChoice

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy
# A prompt longer than this many characters per context token cannot fit (no tokenizer packs
# more than a few characters in a token): rejected before it is tokenized.
MAX_CHARS_PER_TOKEN = 32
MAX_N = 16  # choices per request: each is a sequence in the batch
MAX_STOP = 4  # OpenAI's bound
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_PARTS = 256  # content parts per message
MAX_TOOL_CALLS = 128  # per assistant message
MAX_COMPLETION_LOGPROBS = 5  # legacy completions' bound on logprobs
SEED_MOD = 2**64


def _is_default(*defaults: object) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == d and type(value) is type(d) for d in defaults)


def _is_empty(value: Any) -> bool:
    return value is None or value in ([], {})


# OpenAI request fields (chat and legacy completions) Ember does not implement, with the
# values that mean "not used"; any other value is a 400 naming the field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _is_default(1),
    "suffix": _is_default(""),
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
    """A client mistake: answered with HTTP 400 and an OpenAI-style error body.

    ``param`` is the request field at fault (``messages.0.content.1.type``) when one is;
    ``code`` OpenAI's finer reason (``unsupported_parameter``, ``unknown_parameter``,
    ``invalid_value``) when there is one.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


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
StopString = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)
]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, StringConstraints(max_length=256)]
    arguments: Text  # a JSON string, as OpenAI sends it (bounded by the body's size)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Identifier
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message. ``developer`` is the newer name of ``system`` (rendered as such when the
    template has no developer role); an assistant message may carry ``tool_calls`` (then its
    content may be null) and a ``tool`` message answers one by ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: Identifier | None = None

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content is required (it may be null only on an assistant message with tool_calls)"
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, needs a tool_call_id")
        return self

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines (vLLM's rendering)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template sees it (:mod:`runtime.chat`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False  # honoured: a last chunk with no choices and the usage
    # Obfuscation pads stream events against length side channels. Ember does not pad (as
    # if false were sent), so a client asking for it is refused rather than left unprotected.
    include_obfuscation: StrictBool = False
    # vLLM's extension (load generators such as guidellm send it): with include_usage, every
    # chunk also carries the usage so far.
    continuous_usage_stats: StrictBool = False


class SamplingFields(BaseModel):
    # Strict types, as OpenAI checks them: "5" or true is not a max_tokens, "0.5" not a
    # temperature; NaN and infinities are no number at all.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # newer name of max_tokens; wins
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    # Token id (a decimal string, as JSON keys are) -> bias in [-100, 100]; ids are checked
    # against the model's vocabulary in sampling_params.
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions (llama.cpp's server takes most too), under vLLM's names.
    ignore_eos: StrictBool = False  # decode past end-of-text: benchmarks ask for exact lengths
    top_k: StrictInt = Field(0, ge=-1, le=1 << 20)  # -1 or 0: no cut
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, le=2.0)
    min_tokens: StrictInt = Field(0, ge=0)
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

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's ``continuous_usage_stats``,
        which counts only with ``include_usage``, as in vLLM)."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    # What the response reports beyond the text (overridden per endpoint).
    def logprobs_k(self) -> int | None:
        """Alternatives reported with each sampled token's log-probability (None: none)."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        """Alternatives reported with each prompt token's log-probability (None: none)."""
        return None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Structured outputs and tools: runtime.openai_tools (constrained by runtime.structured).
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: ToolChoice | None = None

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    @property
    def chars(self) -> int:
        """Characters of the messages' text and of their tool calls (ids, names, arguments):
        what templates render from them, less their own markup (bounds the prompt before it
        is tokenized)."""
        return sum(
            len(m.text)
            + len(m.tool_call_id or "")
            + sum(len(c.id) + len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
            for m in self.messages
        )

    @property
    def num_tool_calls(self) -> int:
        """Tool calls of earlier assistant turns the messages replay."""
        return sum(len(m.tool_calls or ()) for m in self.messages)


class CompletionRequest(SamplingFields):
    prompt: Text
    # Legacy completions: the number of alternatives with each token's log-probability.
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False  # the prompt precedes the text (and its tokens the logprobs)

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def chars(self) -> int:
        return len(self.prompt)


def _without_unused(body: Mapping[str, Any], table: Mapping[str, Callable[[Any], bool]], where: str) -> Any:
    """``body`` less the keys of ``table`` that carry their "not used" value; :class:`RequestError`
    naming the first that does not."""
    for name, unused in table.items():
        if name in body and not unused(body[name]):
            raise RequestError(
                f"{where}{name}: Ember does not implement this field",
                f"{where}{name}",
                "unsupported_parameter",
            )
    return {k: v for k, v in body.items() if k not in table}


def _check_messages(messages: list[Any]) -> None:
    """What the message model checks as a whole, named by field: a content part of another
    type than ``text`` (its type and place), a missing ``content`` or ``tool_call_id``."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            where = f"messages.{i}.content"
            raise RequestError(
                f"{where}: Field required (it may be null only on an assistant message with tool_calls)",
                where,
                "invalid_value",
            )
        if role == "tool" and m.get("tool_call_id") is None:
            where = f"messages.{i}.tool_call_id"
            raise RequestError(f"{where}: Field required in a tool message", where, "invalid_value")
        parts = m.get("content")
        if not isinstance(parts, list):
            continue
        if len(parts) > MAX_PARTS:
            raise RequestError(
                f"messages.{i}.content: more than {MAX_PARTS} parts", f"messages.{i}.content", "invalid_value"
            )
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                where = f"messages.{i}.content.{j}.type"
                raise RequestError(
                    f"{where}: Ember does not implement content parts of type {kind[:64]!r} (only 'text')",
                    where,
                    "unsupported_parameter",
                )


# Errors that only say "not this member of a union" (``content`` is a string or a list of
# parts): another member's error says more, when there is one.
_BRANCH_MISMATCH = {
    "string_type",
    "list_type",
    "dict_type",
    "model_type",
    "none_required",
    "int_type",
    "bool_type",
}


def _first_error(exc: ValidationError) -> Any:
    errors = exc.errors()
    return next((e for e in errors if e["type"] not in _BRANCH_MISMATCH), errors[0])


def _is_union_tag(part: object) -> bool:
    """Whether a location part names a union member (``list[TextPart]``), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none"))


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
            _check_messages(body["messages"])
    try:
        request = ChatRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = _first_error(exc)
        where = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
        if first["type"] == "extra_forbidden":
            raise RequestError(f"{where}: unrecognized request field", where, "unknown_parameter") from None
        raise RequestError(f"{where or '(body)'}: {first['msg']}", where or None, "invalid_value") from None
    options = request.stream_options
    if options is not None:
        if not request.stream:  # as OpenAI answers
            raise RequestError(
                "stream_options: only allowed when stream is true", "stream_options", "invalid_value"
            )
        if options.include_obfuscation:
            raise RequestError(
                "stream_options.include_obfuscation: Ember does not implement this field",
                "stream_options.include_obfuscation",
                "unsupported_parameter",
            )
    if isinstance(request, ChatRequest) and request.top_logprobs is not None and not request.logprobs:
        raise RequestError(
            "top_logprobs: only allowed when logprobs is true", "top_logprobs", "invalid_value"
        )
    return request


def _carries_schemas(body: Any) -> bool:
    return isinstance(body, dict) and bool(body.get("tools") or body.get("response_format"))


async def parse_request_async(body: Any, chat: bool) -> ChatRequest | CompletionRequest:
    """:func:`parse_request`, in a thread when the body carries JSON schemas: validating
    compiles them (about a second for the largest allowed tools), and the event loop it
    would block drives the engine's decode steps for every other request."""
    if _carries_schemas(body):
        return await asyncio.to_thread(parse_request, body, chat)
    return parse_request(body, chat)


def check_prompt_chars(chars: int, max_context: int, param: str | None = None) -> None:
    """:class:`RequestError` for a prompt of ``chars`` characters that cannot fit a context of
    ``max_context`` tokens whatever it tokenizes to (checked before tokenizing it)."""
    if chars > max_context * MAX_CHARS_PER_TOKEN:
        raise RequestError(
            f"the prompt has {chars} characters, far more than fit the model's context of "
            f"{max_context} tokens",
            param,
            "context_length_exceeded",
        )


def _logit_bias(request: SamplingFields, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 9 else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(
                f"logit_bias: {key[:32]!r} is not a token id of this model"
                + (f" (0 to {vocab_size - 1})" if vocab_size else ""),
                "logit_bias",
                "invalid_value",
            )
        pairs.append((token, bias))
    return tuple(pairs)


def sampling_params(
    request: SamplingFields,
    prompt_len: int,
    max_context: int,
    default_max: int,
    vocab_size: int | None = None,
) -> SamplingParams:
    """Sampling parameters (of the first choice: :func:`choice_params` gives the others) for a
    prompt of ``prompt_len`` tokens, or :class:`RequestError`.

    ``default_max`` is the function's ``maxTokens``: the default and the cap of ``max_tokens``
    (a request asking for more than the context holds is still an error). ``vocab_size``
    bounds the token ids of ``logit_bias``.
    """
    if prompt_len >= max_context:
        raise RequestError(
            f"the prompt has {prompt_len} tokens and leaves no room in the model's context of "
            f"{max_context} tokens",
            None,
            "context_length_exceeded",
        )
    max_tokens = request.max_tokens or min(default_max, max_context - prompt_len)
    if max_tokens < 1 or prompt_len + max_tokens > max_context:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; with max_tokens={max_tokens} it exceeds the model's "
            f"context of {max_context} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    max_tokens = min(max_tokens, default_max)
    if request.min_tokens > max_tokens:
        raise RequestError(
            f"min_tokens: {request.min_tokens} is more than max_tokens ({max_tokens})",
            "min_tokens",
            "invalid_value",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            # Dividing float32 logits by a vanishing temperature overflows them (NaN probabilities):
            # such a temperature is greedy decoding in all but name.
            temperature=request.temperature if request.temperature >= MIN_TEMPERATURE else 0.0,
            top_p=request.top_p,
            top_k=max(request.top_k, 0),
            min_p=request.min_p,
            seed=request.seed,
            stop=request.stop_strings,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=_logit_bias(request, vocab_size),
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs_k(),
            prompt_logprobs=request.prompt_logprobs_k(),
        )
    except ValueError as exc:
        raise RequestError(str(exc), None, "invalid_value") from None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of ``n``: the first choice's with seed ``seed + index``
    (mod 2**64, kept in the range torch takes), so choices differ and a seeded request repeats.
    Only the first choice asks for prompt log-probabilities (they are the same for all)."""
    if index == 0:
        return params
    seed = params.seed
    if seed is not None:
        seed = (seed + index) % SEED_MOD
    return replace(params, seed=seed, prompt_logprobs=None)
