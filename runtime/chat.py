"""Chat templates (Jinja, as shipped with the model) rendered into prompt text."""

from __future__ import annotations

from typing import Any

from runtime.errors import EmberRuntimeError


class ChatTemplateError(EmberRuntimeError, ValueError):
    code = "chat_template_error"


def render_chat(
    template: str | None, messages: list[dict[str, str]], tokenizer_config: dict[str, Any]
) -> str:
    """The prompt for ``messages`` with the assistant's turn opened (add_generation_prompt)."""
    if not template:
        raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=tokenizer_config.get("bos_token") or "",
            eos_token=tokenizer_config.get("eos_token") or "",
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None
