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
from runtime.openai_api import ChatRequest, Completion, CompletionRequest, RequestError, parse_request
from runtime.openai_tools import request_plan
from runtime.structured import StructuredError

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

    Keyword arguments are OpenAI sampling fields (``max_tokens``, ``temperature``, ``top_p``,
    ``seed``, ``stop``, penalties); invalid ones raise :class:`runtime.openai_api.RequestError`,
    which the worker answers with HTTP 400.
    """

    def __init__(self, binding: ModelBinding, loop: asyncio.AbstractEventLoop) -> None:
        self._binding = binding
        self._loop = loop
        self._loop_thread = threading.get_ident()

    @property
    def model_id(self) -> str:
        return self._binding.template.model.model_id

    async def acomplete(self, prompt: str, **sampling: Any) -> Completion:
        request = parse_request({"prompt": prompt, **sampling}, chat=False)
        return await self._run(request)

    async def achat(self, messages: list[dict[str, str]], **sampling: Any) -> Completion:
        request = parse_request({"messages": messages, **sampling}, chat=True)
        return await self._run(request)

    def complete(self, prompt: str, **sampling: Any) -> Completion:
        """Blocking form of :meth:`acomplete` (for plain, non-async handlers)."""
        return self._block(self.acomplete(prompt, **sampling))

    def chat(self, messages: list[dict[str, str]], **sampling: Any) -> Completion:
        """Blocking form of :meth:`achat` (for plain, non-async handlers)."""
        return self._block(self.achat(messages, **sampling))

    async def _run(self, request: ChatRequest | CompletionRequest) -> Completion:
        try:
            # response_format / tools as on /v1/chat/completions (tool calls stay in the text,
            # in runtime.openai_tools' generic format).
            plan = request_plan(request)
            ids, params = await self._binding.prepare(request, plan)
            constraint = await self._binding.constraint(plan)
        except StructuredError as exc:
            raise RequestError(str(exc)) from None
        return await self._binding.complete(ids, params, constraint)

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
