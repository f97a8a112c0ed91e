"""Summarize ``event["text"]`` in one sentence and answer JSON (an Ember custom handler).

The static initializer runs once per instance; its result (the prompt settings) is reused by
every request, TIDAL's static initialisation.
"""

from __future__ import annotations

from typing import Any

from runtime.sdk import Context, InvalidEvent, init

SYSTEM_PROMPT = "You summarize text. Answer with one short sentence that states the main point."


@init(static=True)
def setup(context: Context) -> dict[str, Any]:
    context.logger.info("summarize: initialising %s", context.model.model_id)
    return {"system": SYSTEM_PROMPT, "max_tokens": 48}


def handler(event: Any, context: Context) -> dict[str, Any]:
    text = event.get("text") if isinstance(event, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise InvalidEvent("the event needs a non-empty string field 'text'")
    settings = context.state
    answer = context.model.chat(
        [{"role": "system", "content": settings["system"]}, {"role": "user", "content": text}],
        max_tokens=settings["max_tokens"],
        temperature=0,
    )
    return {
        "summary": answer.text.strip(),
        "input_chars": len(text),
        "completion_tokens": answer.completion_tokens,
        "request_id": context.request_id,
    }
