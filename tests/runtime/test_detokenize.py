"""Incremental detokenization gives, token by token, the text decoding the whole output gives.

Two decoders, each with arbitrary id sequences (so characters split across tokens, lone
continuation bytes and special tokens anywhere): GPT-2's byte-level one (every GGUF model
Ember imports) and a Llama-style SentencePiece one (``▁`` for spaces, byte fallback, the
first token's leading space stripped).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from runtime.engine.detokenize import Detokenizer, special_ids
from tests.runtime.tiny_gguf import byte_level_vocab


def byte_level() -> Tokenizer:
    tokens, merges, _ = byte_level_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in tokens[:3]])
    return tok


def sentencepiece() -> Tokenizer:
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁", "▁the", "▁h", "e", "llo", "▁wor", "ld", "é", "▁€", "!"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in pieces[:3]])
    return tok


TOKENIZERS = {"byte_level": byte_level(), "sentencepiece": sentencepiece()}


def whole(tok: Tokenizer, ids: list[int], final: bool) -> str:
    text: str = tok.decode(ids, skip_special_tokens=True)
    return text if final else text.rstrip("\ufffd")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TOKENIZERS["byte_level"].get_vocab_size() - 1), max_size=40))
def test_each_step_matches_decoding_the_whole_output(ids: list[int]) -> None:
    """Byte-level decoding is lossy UTF-8 over all the bytes: the same from any whole character
    on, so every step's text is exactly what decoding the whole output gives."""
    tok = TOKENIZERS["byte_level"]
    detok = Detokenizer(tok, special_ids(tok))
    for n in range(1, len(ids) + 1):
        final = n == len(ids)
        assert detok.decoded(ids[:n], final) == whole(tok, ids[:n], final)


def _units(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Pieces, special tokens, and whole characters as byte-fallback tokens (1-4 of them)."""
    chars = ["é", "€", "🤖", "a", "\x00"]
    spelled = [[tok.token_to_id(f"<0x{b:02X}>") for b in c.encode()] for c in chars]
    pieces = [[i] for i in range(tok.get_vocab_size()) if not tok.id_to_token(i).startswith("<0x")]
    return st.sampled_from(spelled + pieces)


@settings(max_examples=300, deadline=None)
@given(st.lists(_units(TOKENIZERS["sentencepiece"]), max_size=20))
def test_each_step_is_a_prefix_of_the_whole_text(units: list[list[int]]) -> None:
    """Byte fallback decodes a run of byte tokens as one: the whole run becomes U+FFFD while
    its last character is unfinished, also the finished ones before it. Step by step, those
    stay emitted, so each step's text is a prefix of the whole output's, and the end is it."""
    tok = TOKENIZERS["sentencepiece"]
    ids = [i for unit in units for i in unit]
    detok = Detokenizer(tok, special_ids(tok))
    text = whole(tok, ids, final=True)
    for n in range(1, len(ids) + 1):
        assert text.startswith(detok.decoded(ids[:n], final=n == len(ids)))
    assert not ids or detok.decoded(ids, final=True) == text


def test_a_split_character_waits_for_its_last_byte() -> None:
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("a€", add_special_tokens=False).ids
    assert len(ids) == 4  # "a" and the three bytes of "€", one token each
    detok = Detokenizer(tok, special_ids(tok))
    assert [detok.decoded(ids[:n]) for n in (1, 2, 3)] == ["a", "a", "a"]  # held: not complete
    assert detok.decoded(ids[:3], final=True) == "a\ufffd" == tok.decode(ids[:3])  # it ends here: as is
    assert detok.decoded(ids) == "a€"


def test_the_leading_space_rule_applies_to_the_output_start_only() -> None:
    tok = TOKENIZERS["sentencepiece"]
    ids = [tok.token_to_id(p) for p in ["▁h", "e", "llo", "▁wor", "ld", "!"]]
    detok = Detokenizer(tok, special_ids(tok))
    texts = [detok.decoded(ids[:n]) for n in range(1, len(ids) + 1)]
    assert texts == ["h", "he", "hello", "hello wor", "hello world", "hello world!"]


class CountingTokenizer:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        text: str = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def test_each_token_decodes_a_few_ids_not_the_whole_output() -> None:
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("the then thé € there " * 200, add_special_tokens=False).ids
    counting = CountingTokenizer(tok)
    detok = Detokenizer(counting, special_ids(tok))
    for n in range(1, len(ids) + 1):
        detok.decoded(ids[:n])
    assert detok.text == tok.decode(ids)
    assert len(ids) > 2000 and max(counting.lengths) <= 4  # the windows: a character's bytes at most


def test_special_tokens_do_not_widen_the_windows() -> None:
    """An end-of-sequence token repeated under ignore_eos adds no text: it stays out of the
    windows, which would otherwise span the whole run of them."""
    tok = TOKENIZERS["sentencepiece"]
    eos, words = tok.token_to_id("</s>"), [tok.token_to_id(p) for p in ["▁h", "e", "llo", "▁wor", "ld"]]
    ids = [*words[:3], *[eos] * 500, *words[3:], *[eos] * 500]
    counting = CountingTokenizer(tok)
    detok = Detokenizer(counting, special_ids(tok))
    texts = [detok.decoded(ids[:n]) for n in range(1, len(ids) + 1)]
    assert texts[-1] == tok.decode(ids) == "hello world"  # " wor" keeps its space after the run
    assert max(counting.lengths) <= 2
