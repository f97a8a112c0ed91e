"""Weight-only int8 / q4: the store layouts, the torch reference, GGUF carry-over, registration."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gpu_pool import store
from gpu_pool.client import PoolClient
from runtime.engine.build import PoolKV, build_engine
from runtime.engine.engine import EngineConfig
from runtime.engine.kv_storage import kv_block_bytes
from runtime.engine.sampling import SamplingParams
from runtime.errors import RegistrationError
from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.models.quant_weight import QuantWeight, bind_weight
from runtime.quant import (
    GGML_Q4_1,
    GGML_Q8_0,
    dequantize,
    from_ggml,
    linear,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)
from runtime.registry import register
from runtime.store_weights import StoreWeights
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

METHODS = [("int8", GGML_Q8_0), ("q4", GGML_Q4_1)]
HEAD = "lm_head.weight"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weights(seed: int, out: int = 48, cols: int = 96) -> np.ndarray:
    """Random weights with the corner cases: an all-zero group and a constant group."""
    w = np.random.default_rng(seed).standard_normal((out, cols), dtype=np.float32) * 0.05
    w[0, :32] = 0.0
    w[1, 32:64] = 0.25
    return w


def as_quant(method: str, planes: dict[str, torch.Tensor]) -> QuantWeight:
    return QuantWeight(method, planes[""], planes[".scales"], planes.get(".mins"))


@pytest.mark.parametrize(("method", "qtype"), METHODS)
def test_quantize_gives_llama_cpp_codes(method: str, qtype: int) -> None:
    """Our quantizer and gguf's (llama.cpp's reference) agree bit for bit, via the carry-over."""
    for seed in range(3):
        w = weights(seed)
        ours = quantize(torch.from_numpy(w), method)
        theirs = from_ggml(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)), qtype, method)
        assert ours.keys() == theirs.keys()
        for suffix, tensor in ours.items():
            assert torch.equal(tensor, theirs[suffix]), suffix


@pytest.mark.parametrize(("method", "qtype"), METHODS)
def test_layout_and_dequantize_match_ggml(method: str, qtype: int) -> None:
    w = weights(7)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    planes = from_ggml(blocks, qtype, method)
    code_dtype, code_cols = (torch.int8, 96) if method == "int8" else (torch.uint8, 48)
    assert planes[""].dtype == code_dtype and planes[""].shape == (48, code_cols)
    assert planes[".scales"].dtype == torch.float16 and planes[".scales"].shape == (48, 3)
    assert (".mins" in planes) == (method == "q4")
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    assert torch.equal(dequantize(as_quant(method, planes)), torch.from_numpy(reference))


@pytest.mark.parametrize("method", ["int8", "q4"])
def test_reconstruction_error_is_within_half_a_step(method: str) -> None:
    w = torch.from_numpy(weights(3))
    planes = quantize(w, method)
    err = (dequantize(as_quant(method, planes)) - w).abs().reshape(48, 3, 32)
    step = planes[".scales"].float()[..., None]
    # half a step, plus the float16 rounding of the scale (x15 for q4's top code) and minimum
    slack = 1e-3 * (w.abs().amax() + 15 * step)
    assert bool((err <= step / 2 + slack).all())
    assert float(err[0, 0].max()) == 0.0  # an all-zero group
    if method == "q4":  # a constant group is its minimum, exactly
        assert float(err[1, 1].max()) == 0.0


def test_q4_packs_the_even_index_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(unpack_nibbles(packed), codes)
    # One group holding 0..15 twice: s = 1, m = 0, every code its own value.
    planes = quantize(torch.arange(32, dtype=torch.float32)[None, :] % 16, "q4")
    assert planes[""][0, :2].tolist() == [0x10, 0x32] and planes[""][0, 8].tolist() == 0x10
    assert planes[".scales"].tolist() == [[1.0]] and planes[".mins"].tolist() == [[0.0]]


@pytest.mark.parametrize("method", ["int8", "q4"])
def test_linear_on_a_quantized_weight_is_linear_on_its_dequantization(method: str) -> None:
    w = as_quant(method, quantize(torch.from_numpy(weights(5)), method))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    assert torch.equal(linear(x, w, bias), F.linear(x, dequantize(w, torch.bfloat16), bias))
    plain = torch.randn(48, 96).to(torch.bfloat16)
    assert torch.equal(linear(x, plain), F.linear(x, plain))


def test_bind_weight_sees_a_weights_quantization() -> None:
    table = {
        f"w{k}{s}": t
        for k in "ab"
        for s, t in quantize(torch.randn(4, 64), "q4" if k == "a" else "int8").items()
    }
    table["plain"] = torch.randn(4, 64)
    a, b, plain = (bind_weight(table, n) for n in ("wa", "wb", "plain"))
    assert isinstance(a, QuantWeight) and a.method == "q4" and (a.out_features, a.in_features) == (4, 64)
    assert isinstance(b, QuantWeight) and b.method == "int8" and b.mins is None and b.in_features == 64
    assert plain is table["plain"]
    table["wb.mins"] = table["wa.mins"]  # int8 codes with minimums: no layout of ours
    with pytest.raises(ValueError, match="int8 codes"):
        bind_weight(table, "wb")


def test_only_aligned_projections_are_quantized() -> None:
    sw = StoreWeights("int8")
    sw.add("model.layers.0.mlp.down_proj.weight", torch.randn(8, 40))  # in = 40: not a multiple of 32
    sw.add("model.layers.0.mlp.up_proj.weight", torch.randn(40, 64))
    sw.add("model.layers.0.input_layernorm.weight", torch.randn(64))
    sw.add("model.embed_tokens.weight", torch.randn(10, 64))
    dtypes = {n: t.dtype for n, t in sw.tensors.items()}
    assert dtypes == {
        "model.layers.0.mlp.down_proj.weight": torch.bfloat16,
        "model.layers.0.mlp.up_proj.weight": torch.int8,
        "model.layers.0.mlp.up_proj.weight.scales": torch.float16,
        "model.layers.0.input_layernorm.weight": torch.bfloat16,
        "model.embed_tokens.weight": torch.bfloat16,
    }
    q = sw.metadata()["quantization"]
    assert q["quantized"] == {"model.layers.0.mlp.up_proj.weight": "quantized"}
    assert "not a multiple of 32" in q["kept_bfloat16"]["model.layers.0.mlp.down_proj.weight"]
    assert StoreWeights("float32").metadata() == {"quantization": None}
    with pytest.raises(RegistrationError, match="quantized source"):
        StoreWeights("bfloat16").add("model.layers.0.mlp.up_proj.weight.scales", torch.randn(40, 2))


def q4_path(root: Path) -> Path:
    write_tiny_gguf(root / "untied.gguf", hf_weights(6))
    return root / "untied.gguf"


@pytest.fixture(scope="module")
def q4_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama GGUF whose projections are Q4_1 (as SmolLM2's), and the home to register it in."""
    root = tmp_path_factory.mktemp("q4src")
    write_tiny_gguf(root / "tiny-q4_1.gguf", hf_weights(5), projections=GGML_Q4_1)
    return root / "tiny-q4_1.gguf", root / "home"


def test_q4_from_q4_1_blocks_is_exact_and_shares_only_unquantized(q4_source: tuple[Path, Path]) -> None:
    src, home = q4_source
    q4, fp32, bf16 = (register(str(src), d, home=home) for d in ("q4", "float32", "bfloat16"))
    assert q4.model_id.endswith("-q4") and q4.record["quantization"] == "q4"
    stored = load_file(str(q4.store_path / store.TENSORS_FILE))
    reference = load_file(str(fp32.store_path / store.TENSORS_FILE))  # gguf's dequantization
    quantized = store.read_metadata(q4.store_path)["quantization"]
    assert quantized["method"] == "q4" and quantized["kept_bfloat16"] == {}
    names = [n for n in reference if n.endswith("_proj.weight")]
    assert len(names) == 2 * len(PROJ) and quantized["quantized"] == dict.fromkeys(names, "carried Q4_1")
    for name in names:  # the q/k rows were un-permuted with their blocks: still exact
        assert torch.equal(dequantize(bind_weight(stored, name)), reference[name]), name  # type: ignore[arg-type]
    manifest, plain = q4.manifest(), bf16.manifest()
    assert {e.name: e.dtype for e in manifest.tensors}[names[0] + ".mins"] == "float16"
    shared = {e.fingerprint for e in manifest.tensors} & {e.fingerprint for e in plain.tensors}
    assert shared == {e.fingerprint for e in plain.tensors if not e.name.endswith("_proj.weight")}
    assert store.verify(manifest) == []
    profile = q4.profile("cpu")
    assert profile["kv_dtype"] == "bfloat16" and profile["weight_bytes"] == manifest.nbytes < plain.nbytes
    assert profile["kv_blocks_per_gib"] > bf16.profile("cpu")["kv_blocks_per_gib"]


def test_int8_carries_q8_0_and_quantizes_anything_else(q4_source: tuple[Path, Path], tmp_path: Path) -> None:
    src, home = q4_source
    from_q4_1 = store.read_metadata(register(str(src), "int8", home=home).store_path)["quantization"]
    assert from_q4_1["quantized"].pop(HEAD) == "quantized int8 (the LM head)"
    assert set(from_q4_1["quantized"].values()) == {"quantized"}
    q8 = tmp_path / "tiny-q8_0.gguf"
    write_tiny_gguf(q8, hf_weights(5), projections=GGML_Q8_0)
    int8, fp32 = (register(str(q8), d, home=tmp_path / "home") for d in ("int8", "float32"))
    meta = store.read_metadata(int8.store_path)["quantization"]
    assert meta["quantized"].pop(HEAD) == "quantized int8 (the LM head)"
    assert set(meta["quantized"].values()) == {"carried Q8_0"}
    stored = load_file(str(int8.store_path / store.TENSORS_FILE))
    reference = load_file(str(fp32.store_path / store.TENSORS_FILE))
    for name in meta["quantized"]:
        assert torch.equal(dequantize(bind_weight(stored, name)), reference[name]), name  # type: ignore[arg-type]


def test_int8_stores_its_tied_lm_head_as_int8_beside_the_bfloat16_embedding(tmp_path: Path) -> None:
    """A decode step reads the whole head, a gather one row of the embedding: the head gets int8
    codes of its own (llama.cpp's Q8_0 output tensor), the embedding stays bfloat16, and the
    model uses the copy (the kernel path's head is tested in tests/runtime/test_llama_decode.py)."""
    weights = hf_weights(5)
    del weights[HEAD]  # tied, as SmolLM2's
    src, home = tmp_path / "tied.gguf", tmp_path / "home"
    write_tiny_gguf(src, weights)
    int8 = register(str(src), "int8", home=home)
    assert int8.config["tie_word_embeddings"]
    stored = load_file(str(int8.store_path / store.TENSORS_FILE))
    head, embed = bind_weight(stored, HEAD), stored["model.embed_tokens.weight"]
    assert isinstance(head, QuantWeight) and head.method == "int8" and embed.dtype == torch.bfloat16
    # (out, in): each value's code step. Half a step, plus 127 codes times the float16 rounding
    # of the scale (2^-11 of it): < 0.6 of a step.
    step = head.scales.float().repeat_interleave(32, dim=1)
    assert ((dequantize(head, torch.float32) - embed.float()).abs() <= 0.6 * step).all()
    model = LlamaModel(LlamaConfig.from_hf(int8.config), stored, cpu_kernels="off")
    assert isinstance(model.lm_head, QuantWeight) and model.lm_head.q is stored[HEAD]
    plain = register(str(src), "bfloat16", home=home)
    assert HEAD not in load_file(str(plain.store_path / store.TENSORS_FILE))  # float: tied as before
    untied = load_file(
        str(register(str(q4_path(tmp_path)), "int8", home=home).store_path / store.TENSORS_FILE)
    )
    assert untied[HEAD].dtype == torch.int8  # an untied head is quantized in place


@pytest.mark.parametrize("method", ["int8", "q4"])
def test_engine_serves_a_quantized_model_from_the_pool(
    method: str, q4_source: tuple[Path, Path], tmp_path: Path
) -> None:
    """Pool views of int8/uint8/float16 planes run the torch fallback (the CPU kernels off: their
    q8_0/q4_1 products are checked against this fallback in tests/runtime/cpu_kernels); greedy
    tokens equal a model over the same weights dequantized up front (what it computes per forward)."""
    src, home = q4_source
    reg = register(str(src), method, home=home)
    config = LlamaConfig.from_hf(reg.config)
    block = int(reg.profile("cpu")["block_size"])
    prompt = [5, 17, 99, 42, 7, 3, 150]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    tok = Tokenizer.from_file(str(reg.directory / "tokenizer.json"))
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(reg.store_path,))
    try:
        with PoolClient(pool.socket_path) as client:
            table = client.acquire(reg.manifest())
            model = LlamaModel(config, table, cpu_kernels="off")
            assert isinstance(model.layers[0].down, QuantWeight)
            engine = build_engine(
                model,
                tok,
                {2},
                PoolKV(client, kv_block_bytes(config, block, torch.bfloat16)),
                torch.bfloat16,
                EngineConfig(block),
            )
            ours = engine.generate([prompt], params)[0].output_ids
            engine.close()
    finally:
        pool.stop()
    plain = load_file(str(reg.store_path / store.TENSORS_FILE))
    dense = {n: t for n, t in plain.items() if not n.endswith((".scales", ".mins"))}
    for name in dense:
        w = bind_weight(plain, name)
        if isinstance(w, QuantWeight):
            dense[name] = dequantize(w, torch.bfloat16)
    assert ours == greedy(LlamaModel(config, dense, cpu_kernels="off"), prompt, len(ours))


def greedy(model: LlamaModel, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens over a private KV tensor, one sequence."""
    kv = torch.zeros(8, *model.config.kv_block_shape(16), dtype=torch.bfloat16)
    tokens = list(prompt)
    for _ in range(steps):
        start = 0 if len(tokens) == len(prompt) else len(tokens) - 1
        new = tokens[start:]
        pos = torch.arange(start, len(tokens))
        batch = Batch(torch.tensor(new), pos, pos, [len(new)], [len(tokens)], torch.arange(8)[None, :])
        tokens.append(int(model.forward(batch, kv)[0].argmax()))
    return tokens[len(prompt) :]
