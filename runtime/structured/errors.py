"""Errors of constrained decoding."""

from __future__ import annotations

from runtime.errors import EmberRuntimeError


class StructuredError(EmberRuntimeError, ValueError):
    """Base of the structured-output errors."""

    code = "structured_output_error"


class SchemaError(StructuredError):
    """A client's JSON schema (or tool parameters) cannot be enforced: too large, too deep,
    malformed, or using a keyword the grammar engine does not implement. ``param`` names the
    request field (``response_format.json_schema.schema``, ``tools.0.function.parameters``):
    answered 400 naming it."""

    code = "invalid_schema"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message


class GrammarError(StructuredError):
    """A grammar failed to compile against a tokenizer, or a matcher reached an error state
    (a bug, never a client mistake: the mask only lets grammatical tokens through)."""

    code = "grammar_error"
