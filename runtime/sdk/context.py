"""What a handler sees: :class:`Context` and the model facade :class:`LLM`; the ``@init`` marker."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.instance import ModelBinding
from runtime.openai_api import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    parse_request,
    parse_request_async,
)
from runtime.openai_response import Completion

_F = TypeVar("_F", bound=Callable[..., Any])
INIT_ATTRIBUTE = "__ember_init__"


def init(static: bool | None = None) -> Callable[[_F], _F]:
    """Mark a module's initializer: ``static=True`` caches its result for the instance's
    lifetime, ``static=False`` re-runs it for every request, ``None`` follows the spec."""

    def mark(fn: _F) -> _F:
        setattr(fn, INIT_ATTRIBUTE, {"static": static})
        return fn

    return mark


class LLM:
    """The instance's model for handlers: ``complete``/``chat`` (and ``a``-prefixed async forms).

    Keyword arguments are the request fields of ``/v1/chat/completions`` (``chat``) and
    ``/v1/completions`` (``complete``), validated as those routes validate them: ``max_tokens``
    / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``, ``stop``,
    ``logit_bias``, penalties, ``logprobs`` (and ``top_logprobs`` for chat), vLLM's ``top_k``,
    ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``. ``stream`` is refused
    (the result is one :class:`~runtime.openai_response.Completion`). Invalid ones raise
    :class:`runtime.openai_api.RequestError`, which the worker answers with HTTP 400.

    A :class:`~runtime.openai_response.Completion` carries the first choice's ``text``,
    ``finish_reason`` and ``logprobs`` (a tuple of :class:`~runtime.openai_response.Logprob`:
    ``token``, ``bytes``, ``logprob``, ``top_logprobs``; None unless asked), every choice in
    ``choices``, usage counts over all choices and, for ``complete(..., echo=True,
    logprobs=k)``, the prompt's ``prompt_logprobs`` (``text`` never includes the prompt).
    Messages take the routes' forms too: ``content`` as a string or a list of text parts,
    roles ``system``, ``developer``, ``user``, ``assistant`` (with ``tool_calls``), ``tool``.
    """

    def __init__(self, binding: ModelBinding, loop: asyncio.AbstractEventLoop) -> None:
        self._binding = binding
        self._loop = loop
        self._loop_thread = threading.get_ident()

    @property
    def model_id(self) -> str:
        return self._binding.template.model.model_id

    async def acomplete(self, prompt: str, **sampling: Any) -> Completion:
        request = parse_request({"prompt": prompt, **_plain(sampling)}, chat=False)
        return await self._run(request)

    async def achat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        request = await parse_request_async({"messages": messages, **_plain(sampling)}, chat=True)
        return await self._run(request)

    def complete(self, prompt: str, **sampling: Any) -> Completion:
        """Blocking form of :meth:`acomplete` (for plain, non-async handlers)."""
        return self._block(self.acomplete(prompt, **sampling))

    def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        """Blocking form of :meth:`achat` (for plain, non-async handlers)."""
        return self._block(self.achat(messages, **sampling))

    async def _run(self, request: ChatRequest | CompletionRequest) -> Completion:
        if request.stream:
            raise RequestError(
                "stream: context.model returns one Completion", "stream", "unsupported_parameter"
            )
        # response_format / tools as on /v1/chat/completions (tool calls stay in the text, in
        # runtime.openai_tools' generic format).
        prepared = await self._binding.prepare_all(request)
        return await self._binding.complete(
            prepared.ids, prepared.params, request.n, prepared.constraints, prepared.adapter
        )

    def _block(self, coro: Any) -> Completion:
        if threading.get_ident() == self._loop_thread:
            coro.close()
            raise RuntimeError("an async handler must await context.model.acomplete()/achat()")
        result: Completion = asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        return result


@dataclass(frozen=True)
class Context:
    """Per-request context handed to ``handler(event, context)`` and to initializers."""

    model: LLM
    spec: dict[str, Any]  # the function spec with defaults filled in
    request_id: str
    logger: logging.Logger
    deadline: float  # time.time() by which the request must finish
    state: Any = None  # the initializer's result (None without one)
    # The request's own environment: an OpenWhisk activation's __OW_* values (runtime.openwhisk),
    # also in os.environ while it runs; empty for other requests.
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def function_name(self) -> str:
        return str(self.spec["metadata"]["name"])

    def remaining_time(self) -> float:
        """Seconds left before the request's deadline (never negative)."""
        return max(0.0, self.deadline - time.time())


def _plain(sampling: dict[str, Any]) -> dict[str, Any]:
    """NumPy (or torch) scalars as the Python numbers they hold: a handler may compute
    ``max_tokens`` or ``seed`` with them, and the request's types are strict (as OpenAI's)."""
    return {
        key: value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else value
        for key, value in sampling.items()
    }
