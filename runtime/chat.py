"""Chat templates (Jinja, as shipped with the model) rendered into prompt text."""

from __future__ import annotations

from typing import Any

from runtime.errors import EmberRuntimeError


class ChatTemplateError(EmberRuntimeError, ValueError):
    code = "chat_template_error"


class ChatTemplate:
    """A model's chat template compiled once (compiling costs ~1.6 ms, importing jinja2 ~20 ms:
    a pre-warmed worker pays both before it has a function)."""

    def __init__(self, template: str | None, tokenizer_config: dict[str, Any]) -> None:
        self.tokenizer_config = tokenizer_config
        self._compiled: Any = None
        # Templates written for tool calling read a ``tools`` variable; others get the tools
        # described in a system message by runtime.openai_tools (its generic format).
        self.supports_tools = bool(template) and "tools" in (template or "")
        if template:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(message)

            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(template)
            except TemplateError as exc:
                raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for ``messages`` with the assistant's turn opened (add_generation_prompt)."""
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        from jinja2 import TemplateError

        try:
            return str(
                self._compiled.render(
                    messages=messages,
                    tools=tools,
                    add_generation_prompt=True,
                    bos_token=self.tokenizer_config.get("bos_token") or "",
                    eos_token=self.tokenizer_config.get("eos_token") or "",
                )
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None


def render_chat(
    template: str | None, messages: list[dict[str, str]], tokenizer_config: dict[str, Any]
) -> str:
    """The prompt for ``messages`` with the assistant's turn opened (compiles the template)."""
    return ChatTemplate(template, tokenizer_config).render(messages)
