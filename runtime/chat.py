"""Chat templates (Jinja, as shipped with the model) rendered into prompt text.

Messages reach the template as OpenAI sends them (``role``, ``content`` as a string, an
assistant's ``tool_calls`` with ``function.arguments`` parsed from JSON into an object when
it is one, as vLLM and Hugging Face templates expect, a tool message's ``tool_call_id``),
with the request's ``tools`` (OpenAI's list of ``{"type": "function", "function": {...}}``)
as the template variable ``tools``.

Many templates know nothing of some of these. What a template does not handle is rewritten
into what it does, in one generic format (Hermes'/Qwen's, which small models have most
likely seen):

- ``developer`` messages become ``system`` messages unless the template mentions the
  ``developer`` role;
- ``tools`` the template never reads are listed in a system message (the first one, extended,
  or a new one in front): a line of instructions, then each tool as JSON between ``<tools>``
  and ``</tools>``; a call is expected back as ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``;
- an assistant message's ``tool_calls``, when the template never reads ``tool_calls``, are
  appended to its content in that same ``<tool_call>`` form;
- ``tool`` messages, when the template has no ``tool`` role, become ``user`` messages whose
  content is the result between ``<tool_response>`` and ``</tool_response>``.

Whether a template handles something is read from its source (the variables it uses and
the role names it mentions), once, when it is compiled.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.errors import EmberRuntimeError

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are "
    "listed as JSON between <tools> and </tools>. To call a function, reply with "
    '<tool_call>{"name": <function-name>, "arguments": <arguments-json-object>}</tool_call>.'
)


class ChatTemplateError(EmberRuntimeError, ValueError):
    code = "chat_template_error"


class ChatTemplate:
    """A model's chat template compiled once (compiling costs ~1.6 ms, importing jinja2 ~20 ms:
    a pre-warmed worker pays both before it has a function)."""

    def __init__(self, template: str | None, tokenizer_config: dict[str, Any]) -> None:
        self.tokenizer_config = tokenizer_config
        self._compiled: Any = None
        self.reads_tools = self.reads_tool_calls = self.has_tool_role = self.has_developer = False
        if template:
            from jinja2 import TemplateError, meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(message)

            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(template)
                self.reads_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
            except TemplateError as exc:
                raise ChatTemplateError(f"chat template does not compile: {exc}") from None
            self.reads_tool_calls = "tool_calls" in template
            self.has_tool_role = "'tool'" in template or '"tool"' in template
            self.has_developer = "developer" in template

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for ``messages`` (and ``tools``, when given) with the assistant's turn
        opened (add_generation_prompt); see the module docstring for what is rewritten."""
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        messages = self._adapt(messages, tools)
        variables: dict[str, Any] = {}
        if tools and self.reads_tools:
            variables["tools"] = tools
        try:
            return str(
                self._compiled.render(
                    messages=messages,
                    add_generation_prompt=True,
                    bos_token=self.tokenizer_config.get("bos_token") or "",
                    eos_token=self.tokenizer_config.get("eos_token") or "",
                    **variables,
                )
            )
        except Exception as exc:  # the model's code, sandboxed: any failure is its own
            # ChatTemplateError (raise_exception) is a ValueError: the template's own message.
            if isinstance(exc, ChatTemplateError):
                raise
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    def _adapt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for given in messages:
            m = dict(given)
            role = m["role"]
            if m.get("content") is None:
                m["content"] = ""
            if role == "developer" and not self.has_developer:
                m["role"] = "system"
            elif role == "assistant" and m.get("tool_calls"):
                m["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
                if not self.reads_tool_calls:
                    calls = "\n".join(_tool_call_text(c) for c in m.pop("tool_calls"))
                    m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
            elif role == "tool" and not self.has_tool_role:
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        if tools and not self.reads_tools:
            listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            preamble = f"{TOOLS_PREAMBLE}\n<tools>\n{listed}\n</tools>"
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call with its JSON ``arguments`` string parsed (templates index into it)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "function": function}


def _tool_call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    tokenizer_config: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt for ``messages`` with the assistant's turn opened (compiles the template)."""
    return ChatTemplate(template, tokenizer_config).render(messages, tools)
