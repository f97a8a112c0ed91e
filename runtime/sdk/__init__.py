"""The function SDK (TIDAL's programming model): ``handler(event, context)`` plus ``@init``.

A custom function is ``module.py:function`` in its spec. The module may mark one initializer
with ``@init(static=True)`` (run once per instance, result cached across requests) or
``@init(static=False)`` (run before every request: TIDAL's dynamic functions). Without an
argument the spec's ``init: static|dynamic`` decides. Initializers and handlers may be plain
or ``async`` functions; plain ones run in a thread so they may call ``context.model``'s
blocking methods. ``context`` gives the model, the function spec, the request id, a logger,
the initializer's result and the time left before the request's deadline. Raising
:class:`InvalidEvent` answers HTTP 400; any other exception is a function error (HTTP 500).
"""

from runtime.openai_api import RequestError as InvalidEvent
from runtime.openai_response import Choice, Completion, Logprob
from runtime.sdk.context import LLM, Context, init
from runtime.sdk.handler import HandlerError, HandlerRunner, load_handler

__all__ = [
    "LLM",
    "Choice",
    "Completion",
    "Context",
    "HandlerError",
    "HandlerRunner",
    "InvalidEvent",
    "Logprob",
    "init",
    "load_handler",
]
