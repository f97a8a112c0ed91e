"""A tiny random-weight Llama written as GGUF the way llama.cpp's converter writes one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.gguf_import import permute
from runtime.registry import RegisteredModel, register

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """GPT-2 byte-level alphabet + a few merges + two control tokens."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = [chr(c) for c in cs]
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe", "in"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def hf_weights(seed: int = 0, layers: int = LAYERS) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face layout (untied lm_head); ``layers`` sets the size
    (about 37 KB of float32 per layer on top of 68 KB)."""
    rng = np.random.default_rng(seed)
    vocab = len(byte_level_vocab()[0])
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN), dtype=np.float32)
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rng.standard_normal(HIDDEN, dtype=np.float32)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN), dtype=np.float32)
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal(
            (KV_HEADS * HEAD_DIM, HIDDEN), dtype=np.float32
        )
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal(
            (KV_HEADS * HEAD_DIM, HIDDEN), dtype=np.float32
        )
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((HIDDEN, HEADS * HEAD_DIM), dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = rng.standard_normal(HIDDEN, dtype=np.float32)
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((INTER, HIDDEN), dtype=np.float32)
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((INTER, HIDDEN), dtype=np.float32)
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((HIDDEN, INTER), dtype=np.float32)
    w["model.norm.weight"] = rng.standard_normal(HIDDEN, dtype=np.float32)
    w["lm_head.weight"] = rng.standard_normal((vocab, HIDDEN), dtype=np.float32)
    return w


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], projections: int | None = None) -> None:
    """Write ``weights`` as a llama GGUF: llama.cpp names, permuted q/k, F32 tensors; the layers'
    projection weights as GGML type ``projections`` (e.g. Q4_1, quantized by ``gguf``) if given."""
    import gguf

    tokens, merges, types = byte_level_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    layers = [int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")]
    w.add_block_count(1 + max(layers, default=LAYERS - 1))  # the layers written (hf_weights' layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    suffixes = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, array in weights.items():
        data = array
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{suffixes[rest]}"
            if rest == "self_attn.q_proj.weight":
                data = permute(array, HEADS)
            elif rest == "self_attn.k_proj.weight":
                data = permute(array, KV_HEADS)
        else:
            gname = names[name]
        if projections is not None and name.endswith("_proj.weight"):
            qtype = gguf.GGMLQuantizationType(projections)
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
            continue
        w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def register_tiny(root: Path) -> RegisteredModel:
    """The tiny model (seed 3) written under ``root`` and registered as float32 in ``root/home``."""
    write_tiny_gguf(root / "tiny.gguf", hf_weights(3))
    return register(str(root / "tiny.gguf"), "float32", home=root / "home")
