"""Chat templates: every OpenAI role and tools, through templates that know them and ones that
do not (the generic rendering of runtime.chat)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.chat import TOOLS_PREAMBLE, ChatTemplate, ChatTemplateError

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Knows tools, tool calls (indexing into parsed arguments), the tool and developer roles.
AWARE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}RESULT[{{ m.tool_call_id }}] {{ m.content }}\n"
    "{% elif m.role == 'developer' %}DEV {{ m.content }}\n"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} x={{ c.function.arguments.x }}"
    "{% endfor %}\n"
    "{% else %}{{ m.role }} {{ m.content }}\n{% endif %}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"x": 1}'}}
MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": "find x"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
]


def test_a_template_without_tools_or_roles_gets_the_generic_rendering() -> None:
    template = ChatTemplate(CHATML, {})
    assert not (template.reads_tools or template.reads_tool_calls or template.has_tool_role)
    prompt = template.render(MESSAGES, TOOLS)
    listed = json.dumps(TOOLS[0])
    assert prompt.startswith(
        f"<|im_start|>system\nbe brief\n\n{TOOLS_PREAMBLE}\n<tools>\n{listed}\n</tools><|im_end|>"
    )
    call = '<tool_call>\n{"name": "lookup", "arguments": {"x": 1}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # No system message: the tools get one of their own; without tools nothing is added.
    alone = template.render([{"role": "user", "content": "hi"}], TOOLS)
    assert alone.startswith(f"<|im_start|>system\n{TOOLS_PREAMBLE}")
    assert (
        template.render([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_knows_tools_and_roles_gets_them_as_they_are() -> None:
    template = ChatTemplate(AWARE, {})
    assert (
        template.reads_tools
        and template.reads_tool_calls
        and template.has_tool_role
        and template.has_developer
    )
    prompt = template.render(MESSAGES, TOOLS)
    # (trim_blocks, as Hugging Face renders: a newline right after a block tag goes.)
    assert prompt == "TOOLS lookup;DEV be brief\nuser find x\nCALL lookup x=1RESULT[c1] 42\n"
    assert TOOLS_PREAMBLE not in prompt


def test_template_failures_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}", {}).render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="chat template failed: TypeError"):
        ChatTemplate("{{ 1 + messages[0]['content'] }}", {}).render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate(None, {}).render(MESSAGES)
