"""The kernel-backed forward pass (runtime.models.llama_decode) against transformers and the torch path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from runtime.cpu_kernels import ops
from runtime.engine.build import PrivateKV, build_engine
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SchedulerConfig
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.registry import RegisteredModel, register
from tests.runtime.cpu_kernels.test_ops import quantize_q4_1, quantize_q8_0
from tests.runtime.test_llama import BLOCK, hf_model, make_batch
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

_EXT = ops.load("auto")
AVAILABLE = ops.available_isas()
# Logits of the "gqa" test model with int8 codes for the activations against fp32 ones: the codes
# move each activation by up to half a step (max|x of its group| / 254).
Q8_CODES_ATOL = 0.05
pytestmark = pytest.mark.skipif(_EXT is None, reason="runtime._cpu_kernels is not built")


@pytest.fixture(params=["generic", "avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> str:
    if request.param not in AVAILABLE:
        pytest.skip(f"this CPU lacks the {request.param} path")
    return str(request.param)


def run_script(model: LlamaModel, kv: torch.Tensor, reference: Any) -> None:
    """Prefill two sequences, decode both across block boundaries, then a chunk after a context."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 97, (11,), generator=g).tolist()
    b = torch.randint(0, 97, (6,), generator=g).tolist()
    blocks_a, blocks_b = [7, 2, 9, 30, 11], [5, 1, 20]
    logits = model.forward(make_batch([(a, 0, blocks_a), (b, 0, blocks_b)]), kv)
    reference(logits[0], a)
    reference(logits[1], b)
    for step in range(6):
        ta, tb = (step * 13) % 97, (step * 29 + 3) % 97
        logits = model.forward(make_batch([([ta], len(a), blocks_a), ([tb], len(b), blocks_b)]), kv)
        a.append(ta)
        b.append(tb)
        reference(logits[0], a)
        reference(logits[1], b)
    chunk = [3, 1, 4]
    logits = model.forward(make_batch([(chunk, len(a), blocks_a)]), kv)
    reference(logits[0], a + chunk)


@pytest.mark.parametrize("kind", ["gqa", "tied", "qwen2", "llama3"])
def test_every_step_through_the_kernels_matches_transformers(kind: str, isa: str) -> None:
    ref, cfg = hf_model(kind)
    config = LlamaConfig.from_hf(cfg)
    model = LlamaModel(config, dict(ref.state_dict()), cpu_kernels=isa)
    assert model.cpu_kernels is not None
    model.cpu_kernels.prefill_tokens = 1 << 30  # prefill and chunks too, not only decode
    kv = torch.zeros(32, *config.kv_block_shape(BLOCK))

    def reference(got: torch.Tensor, tokens: list[int]) -> None:
        with torch.no_grad():
            want = ref(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    run_script(model, kv, reference)


def quantized_model(scheme: str, isa: str) -> tuple[LlamaModel, LlamaModel]:
    """The "gqa" model with its projections quantized to ``scheme``, through the kernels of
    ``isa``, and the same weights dequantized, through torch."""
    ref, cfg = hf_model("gqa")
    config = LlamaConfig.from_hf(cfg)
    quantize = quantize_q8_0 if scheme == "q8_0" else quantize_q4_1
    packed: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, t in ref.state_dict().items():
        # The projections (runtime.quant's registration), and for int8 the LM head too
        # (runtime.store_weights.StoreWeights.quantize_head).
        if t.dim() == 2 and (".layers." in name or (scheme == "q8_0" and name == "lm_head.weight")):
            w = quantize(t)
            packed[name], dense[name] = w.data, w.dequantize()
            packed[name + ".scales"] = w.scales  # type: ignore[assignment]
            if w.mins is not None:
                packed[name + ".mins"] = w.mins
        else:
            packed[name] = dense[name] = t
    return LlamaModel(config, packed, cpu_kernels=isa), LlamaModel(config, dense, cpu_kernels="off")


def script_steps(model: LlamaModel) -> list[torch.Tensor]:
    steps: list[torch.Tensor] = []
    run_script(model, torch.zeros(32, *model.config.kv_block_shape(BLOCK)), lambda got, _: steps.append(got))
    return steps


@pytest.mark.parametrize("scheme", ["q8_0", "q4_1"])
def test_quantized_weights_match_their_dequantized_torch_model(scheme: str, isa: str) -> None:
    model, torch_model = quantized_model(scheme, isa)
    assert model.cpu_kernels is not None
    model.cpu_kernels.q8_codes = False  # fp32 activations (the codes: the test below)
    config = model.config
    kv, kv_ref = (torch.zeros(32, *config.kv_block_shape(BLOCK)) for _ in range(2))
    steps: list[torch.Tensor] = []
    run_script(model, kv, lambda got, _: steps.append(got))
    it = iter(steps)
    run_script(
        torch_model, kv_ref, lambda want, _: torch.testing.assert_close(next(it), want, atol=1e-4, rtol=1e-4)
    )


def test_q8_codes_stay_close_to_the_dequantized_torch_model(isa: str) -> None:
    """int8 weights with the activations as int8 codes (the default where the path has integer
    dots, as llama.cpp's Q8_0): every step's logits within the codes' rounding of the fp32
    model's, and the same greedy token; bit for bit the fp32-activation path elsewhere."""
    model, torch_model = quantized_model("q8_0", isa)
    plain, _ = quantized_model("q8_0", isa)
    assert model.cpu_kernels is not None and plain.cpu_kernels is not None
    plain.cpu_kernels.q8_codes = False
    got, fp32_x, want = script_steps(model), script_steps(plain), script_steps(torch_model)
    ext = ops.load(isa)
    assert ext is not None
    codes = ext.q8_dot()
    ops.load("auto")
    for g, p, w in zip(got, fp32_x, want, strict=True):
        if not codes:
            assert torch.equal(g, p)
        torch.testing.assert_close(g, w, atol=Q8_CODES_ATOL, rtol=0)
        assert int(g.argmax()) == int(w.argmax())
    assert not codes or any(not torch.equal(g, p) for g, p in zip(got, fp32_x, strict=True))


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(root / "tiny.gguf", hf_weights(3))
    return register(str(root / "tiny.gguf"), "bfloat16", home=root / "home")


def engine(reg: RegisteredModel, choice: str, dtype: torch.dtype) -> Engine:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(reg.store_path).rglob("*.safetensors")):
        weights.update(load_file(str(f)))
    model = LlamaModel(LlamaConfig.from_hf(reg.config), weights, cpu_kernels=choice)
    tok = Tokenizer.from_file(str(reg.directory / "tokenizer.json"))
    return build_engine(model, tok, {2}, PrivateKV(96), dtype, EngineConfig(BLOCK, 8, SchedulerConfig()))


def test_engine_greedy_tokens_equal_the_torch_path(tiny_bf16: RegisteredModel, isa: str) -> None:
    """bf16 weights and KV, a batch of prompts of different lengths: the same greedy tokens."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (1, 5, 9, 3, 12)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    outs = []
    for choice in ("off", isa):
        eng = engine(tiny_bf16, choice, torch.bfloat16)
        outs.append([s.output_ids for s in eng.generate(prompts, params)])
    assert outs[0] == outs[1]


def test_a_kv_tensor_is_not_kept_alive_by_the_kernel_path() -> None:
    import gc
    import weakref

    ref, cfg = hf_model("gqa")
    config = LlamaConfig.from_hf(cfg)
    model = LlamaModel(config, dict(ref.state_dict()))
    assert model.cpu_kernels is not None
    kv = torch.zeros(32, *config.kv_block_shape(BLOCK))
    model.forward(make_batch([([5], 3, [2])]), kv)  # a decode step: the kernels bind this tensor
    alive = weakref.ref(kv)
    del kv
    gc.collect()
    assert alive() is None  # an engine's arena view dies with the engine
    model.forward(make_batch([([5], 3, [2])]), torch.zeros(32, *config.kv_block_shape(BLOCK)))


def test_an_engine_builds_its_kernel_step_before_its_first_request(
    tiny_bf16: RegisteredModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The descriptors and scratch of the kernel path are made with the engine (a standby's
    preparation), not by the first step: its first request finds the step already there."""
    from runtime.models import llama_decode

    built: list[object] = []
    make = llama_decode.KernelStep.__init__

    def counted(self: llama_decode.KernelStep, *args: Any) -> None:
        built.append(self)
        make(self, *args)

    monkeypatch.setattr(llama_decode.KernelStep, "__init__", counted)
    eng = engine(tiny_bf16, "auto", torch.bfloat16)
    assert len(built) == 1
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(built) == 1


def test_bf16_prefills_take_the_kernels_on_the_avx2_path() -> None:
    # No bf16 instructions for oneDNN's GEMM there: the kernels were 2.6-3.6x faster at 8-512
    # new tokens. An fp32 model's long prefill, and any on the other paths, stays with torch.
    if "avx2" not in AVAILABLE:
        pytest.skip("this CPU lacks the avx2 path")
    ref, cfg = hf_model("gqa")
    config = LlamaConfig.from_hf(cfg)
    long = make_batch([(list(range(40)), 0, list(range(40 // BLOCK)))])
    short = make_batch([(list(range(8)), 0, [0, 1])])
    for isa, dtype, wants_long in (
        ("avx2", torch.bfloat16, True),
        ("avx2", torch.float32, False),
        ("generic", torch.bfloat16, False),
    ):
        weights = {k: v.to(dtype) for k, v in ref.state_dict().items()}
        path = LlamaModel(config, weights, cpu_kernels=isa).cpu_kernels
        assert path is not None and path.isa == isa
        assert path.wants(long) is wants_long, (isa, dtype)
        assert path.wants(short)
