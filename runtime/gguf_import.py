"""GGUF → Hugging Face layout: weights, architecture config and tokenizer.

Tensors are dequantized with the ``gguf`` package (or handed over as their GGML blocks, for a
quantized registration that keeps them) and renamed to Hugging Face names.
llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` of ``llama`` models (it
interleaves the two rotary halves of each head); :func:`reverse_permute` undoes that so the
weights match the Hugging Face layout that ``transformers`` and our model code expect.
The tokenizer (GPT-2-style byte-level BPE) is rebuilt from the GGUF vocabulary, merges and
token types with ``tokenizers``; the chat template comes from the GGUF metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from runtime.errors import RegistrationError
from runtime.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# GGUF per-layer tensor suffix -> Hugging Face suffix, in the order a forward pass reads them.
_LAYER_NAMES = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
]
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens


class GGMLBlocks(NamedTuple):
    """A tensor's GGML blocks, undecoded: uint8 (rows, bytes per row), rows in Hugging Face order."""

    qtype: int  # gguf.GGMLQuantizationType
    rows: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """What registration needs from a GGUF file."""

    architecture: str
    config: dict[str, Any]  # Hugging Face config.json contents
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    tensor_names: list[str]  # Hugging Face names, in access order
    _reader: GGUFFile
    _gguf_names: dict[str, str]  # HF name -> GGUF name

    def close(self) -> None:
        """Unmap the file (tensors already yielded are independent copies)."""
        self._reader.close()

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Dequantized float32 tensors in Hugging Face layout, in access order."""
        for name, array in self.tensors_or_blocks(lambda _name, _qtype: False):
            assert isinstance(array, np.ndarray)
            yield name, array

    def tensors_or_blocks(
        self, carry: Callable[[str, int], bool]
    ) -> Iterator[tuple[str, np.ndarray | GGMLBlocks]]:
        """Like :meth:`tensors`, but a tensor for which ``carry(hf_name, ggml_type)`` holds comes
        as its :class:`GGMLBlocks` (rows un-permuted like the weights: blocks run along rows)."""
        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        for hf_name in self.tensor_names:
            gguf_name = self._gguf_names[hf_name]
            qtype = self._reader.tensors[gguf_name].qtype
            blocks = carry(hf_name, qtype)
            array = self._reader.rows(gguf_name) if blocks else self._reader.dequantize(gguf_name)
            if self.architecture == "llama" and hf_name.endswith("q_proj.weight"):
                array = reverse_permute(array, heads)
            elif self.architecture == "llama" and hf_name.endswith("k_proj.weight"):
                array = reverse_permute(array, kv_heads)
            yield hf_name, (GGMLBlocks(qtype, np.array(array)) if blocks else array)  # a copy: close() unmaps


def reverse_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection (or bias).

    llama.cpp stores each head's rows as (head_dim/2, 2) interleaved pairs; Hugging Face
    keeps the two rotary halves contiguous: (2, head_dim/2).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (H, D/2, 2, ...)
    return np.ascontiguousarray(w.swapaxes(1, 2)).reshape(weight.shape)  # (H, 2, D/2, ...) -> rows


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of :func:`reverse_permute`), for tests."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, 2, half, *weight.shape[1:])  # (H, 2, D/2, ...)
    return np.ascontiguousarray(w.swapaxes(1, 2)).reshape(weight.shape)


def read_gguf(path: Path) -> GGUFModel:
    """Parse a GGUF file's metadata and tensor index (tensor data is read lazily)."""
    reader = GGUFFile(path)
    try:
        return _read(path, reader)
    except BaseException:
        reader.close()
        raise


def _read(path: Path, reader: GGUFFile) -> GGUFModel:
    field: Callable[[str], Any] = lambda key: _field(reader, key)  # noqa: E731
    arch = str(field("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise RegistrationError(f"{path}: architecture {arch!r} is not supported (supported: {supported})")
    names = set(reader.tensors)
    if "rope_freqs.weight" in names:
        raise RegistrationError(f"{path}: llama3-style rope_freqs in GGUF are not supported yet")
    layers = int(field(f"{arch}.block_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(f"{arch}.context_length")),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
    }
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight"}
    for i in range(layers):
        for g, h in _LAYER_NAMES:
            if f"blk.{i}.{g}" in names:
                gguf_names[f"model.layers.{i}.{h}"] = f"blk.{i}.{g}"
    gguf_names["model.norm.weight"] = "output_norm.weight"
    if "output.weight" in names:
        gguf_names["lm_head.weight"] = "output.weight"
    missing = [g for g in gguf_names.values() if g not in names]
    if missing:
        raise RegistrationError(f"{path}: tensors {missing[:4]} are missing")
    unused = names - set(gguf_names.values())
    if unused:
        raise RegistrationError(f"{path}: tensors {sorted(unused)[:4]} have no Hugging Face counterpart here")
    tokenizer_json, tokenizer_config = _tokenizer(reader, tokens)
    return GGUFModel(arch, config, tokenizer_json, tokenizer_config, list(gguf_names), reader, gguf_names)


def _tokenizer(reader: GGUFFile, tokens: list[str]) -> tuple[str, dict[str, Any]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = str(_field(reader, "tokenizer.ggml.model"))
    if model != "gpt2":
        raise RegistrationError(f"tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    merges: list[tuple[str, str]] = []
    for m in _strings(reader, "tokenizer.ggml.merges"):
        left, _, right = m.partition(" ")
        merges.append((left, right))
    types = _ints(reader, "tokenizer.ggml.token_type")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)), use_regex=True
    )
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if pre == "smollm":
        # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2's regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        # Other pre-tokenizers (llama-bpe, qwen2, ...) split text differently: refuse rather
        # than tokenize prompts wrongly without a word.
        raise RegistrationError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2)")
    if len(types) != len(tokens):
        raise RegistrationError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _TOKEN_TYPE_CONTROL
        ]
    )

    def token(key: str) -> str | None:
        idx = _field(reader, key, None)
        return tokens[int(idx)] if idx is not None else None

    config = {
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template", None),
    }
    return tok.to_str(), config


def _field(reader: GGUFFile, key: str, default: Any = ...) -> Any:
    if key not in reader.fields:
        if default is ...:
            raise RegistrationError(f"GGUF metadata {key!r} is missing")
        return default
    return reader.fields[key]


def _strings(reader: GGUFFile, key: str) -> list[str]:
    values = _field(reader, key)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise RegistrationError(f"GGUF metadata {key!r} must be a list of strings")
    return values


def _ints(reader: GGUFFile, key: str) -> list[int]:
    values = _field(reader, key)
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        raise RegistrationError(f"GGUF metadata {key!r} must be a list of integers")
    return values


def write_hf_metadata(model: GGUFModel, directory: Path) -> None:
    """Write config.json, tokenizer.json and tokenizer_config.json into ``directory``."""
    (directory / "config.json").write_text(json.dumps(model.config, indent=1))
    (directory / "tokenizer.json").write_text(model.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(model.tokenizer_config, indent=1))
