"""Grammars compiled against one tokenizer, cached per (tokenizer, grammar digest)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from runtime.structured.constraint import Constraint
from runtime.structured.errors import GrammarError, SchemaError
from runtime.structured.spec import GrammarSpec

DEFAULT_CAPACITY = 64  # compiled grammars kept (each a few KB to a few MB of lexer state)


class GrammarCache:
    """Compiles :class:`GrammarSpec` s for one ``tokenizers.Tokenizer`` and hands out one
    :class:`Constraint` per sequence (a cheap copy of the cached, compiled matcher).

    The llguidance tokenizer (~0.2 s for a 49k vocabulary) is built on first use, not when
    the engine starts: only constrained requests pay for it. Thread-safe (compilation may run
    in a worker thread while the event loop hands out constraints).
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: Iterable[int],
        vocab_size: int | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        if not self._eos:
            raise ValueError("a grammar needs at least one end-of-sequence token")
        self.vocab_size = vocab_size or int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.capacity = capacity
        self._lock = threading.Lock()
        self._ll: Any = None
        self._tokenizer_key = ""
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _llg_tokenizer(self) -> Any:
        if self._ll is None:
            from llguidance import LLTokenizer

            text = self._tokenizer.to_str()
            self._tokenizer_key = hashlib.sha256(text.encode()).hexdigest()[:16]
            self._ll = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._ll

    def __len__(self) -> int:
        return len(self._compiled)

    def compiled(self, spec: GrammarSpec) -> Any:
        """The compiled matcher of ``spec`` (compiled now unless cached); :class:`GrammarError`."""
        from llguidance import LLMatcher

        with self._lock:
            ll = self._llg_tokenizer()
            key = (self._tokenizer_key, spec.digest)
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
            matcher = LLMatcher(ll, spec.grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(f"the {spec.kind} grammar does not compile: {matcher.get_error()}")
            # The first mask, on a copy: a schema whose $refs loop without producing a token
            # validates and compiles, yet allows nothing. Refused here, naming its field.
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                raise SchemaError(spec.param, "cannot be enforced: no output can satisfy it")
            self._compiled[key] = matcher
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
            return matcher

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh per-sequence constraint for ``spec`` (its checks compiled and probed first)."""
        for check in spec.checks:
            self.compiled(check)
        return Constraint(self.compiled(spec).deep_copy(), self.vocab_size)
