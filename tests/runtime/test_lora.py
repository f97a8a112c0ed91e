"""LoRA applied unmerged, per sequence: parity with merged weights, mixed batches, prefix keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from bench.lora_files import write_adapter
from runtime.adapters import RegisteredAdapter, register_adapter
from runtime.engine.build import PrivateKV, build_engine
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.models.lora import MODULES, LoraAdapter, LoraBatch
from runtime.registry import RegisteredModel
from tests.runtime.tiny_gguf import register_tiny

BLOCK = 4
PROMPTS = ([5, 9, 33, 71, 12, 8, 40, 41, 42], [77, 3, 19, 19, 60])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    return register_tiny(tmp_path_factory.mktemp("tiny-lora"))


@pytest.fixture(scope="module")
def adapters(tiny: RegisteredModel, tmp_path_factory: pytest.TempPathFactory) -> list[RegisteredAdapter]:
    root = tmp_path_factory.mktemp("adapters")
    qv = write_adapter(root / "qv", tiny.config, seed=1, rank=8, std=0.2)
    every = write_adapter(
        root / "all", tiny.config, seed=2, rank=4, alpha=8.0, targets=tuple(MODULES), std=0.2
    )
    return [register_adapter(str(d), "float32", home=root / "home") for d in (qv, every)]


def base_weights(tiny: RegisteredModel) -> dict[str, torch.Tensor]:
    return load_file(str(tiny.store_path / "tensors.safetensors"))


def bound(adapter: RegisteredAdapter, model: LlamaModel) -> LoraAdapter:
    return adapter.bind(load_file(str(adapter.store_path / "tensors.safetensors")), model)


def merged(tiny: RegisteredModel, adapter: RegisteredAdapter) -> LlamaModel:
    """The base with ``W + scale * B @ A`` folded into every adapted projection."""
    weights = dict(base_weights(tiny))
    lora = load_file(str(adapter.store_path / "tensors.safetensors"))
    for name in lora:
        if ".lora_A." in name:
            base = name.replace(".lora_A.weight", ".weight")
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            weights[base] = weights[base] + adapter.config.scale * (b @ lora[name])
    return LlamaModel(LlamaConfig.from_hf(tiny.config), weights, cpu_kernels="off")


def with_adapters(tiny: RegisteredModel, adapters: list[RegisteredAdapter], **kw: str) -> LlamaModel:
    model = LlamaModel(LlamaConfig.from_hf(tiny.config), base_weights(tiny), **kw)  # type: ignore[arg-type]
    model.adapters.update({a.adapter_id: bound(a, model) for a in adapters})
    return model


def engine(tiny: RegisteredModel, model: LlamaModel) -> Engine:
    tok = Tokenizer.from_file(str(tiny.directory / "tokenizer.json"))
    return build_engine(model, tok, {2}, PrivateKV(64), torch.float32, EngineConfig(BLOCK))


def prefill(model: LlamaModel, ids: list[int], lora: LoraBatch | None) -> torch.Tensor:
    cfg = model.config
    n = len(ids)
    nb = -(-n // BLOCK)
    kv = torch.zeros(nb, *cfg.kv_block_shape(BLOCK))
    pos = torch.arange(n)
    batch = Batch(torch.tensor(ids), pos, pos, [n], [n], torch.arange(nb)[None, :], None, lora)
    return model.forward(batch, kv)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("which", [0, 1])
def test_unmerged_matches_merged_weights(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter], which: int
) -> None:
    adapter = adapters[which]
    ours = with_adapters(tiny, adapters)
    lora = LoraBatch.build([ours.adapters[adapter.adapter_id]], [len(PROMPTS[0])])
    reference = merged(tiny, adapter)
    got, want = prefill(ours, PROMPTS[0], lora), prefill(reference, PROMPTS[0], None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = prefill(ours, PROMPTS[0], None)
    assert (got - base).abs().max() > 1e-2  # the adapter does change the output
    # Greedy decoding through the engine: prefill and torch-path decode steps.
    seq = engine(tiny, ours).generate([PROMPTS[0]], GREEDY, [adapter.adapter_id])[0]
    ref = engine(tiny, reference).generate([PROMPTS[0]], GREEDY)[0]
    assert seq.output_ids == ref.output_ids


def test_bf16_unmerged_matches_merged_at_bf16_tolerance(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter]
) -> None:
    adapter = adapters[1]
    cfg = LlamaConfig.from_hf(tiny.config)
    weights = {k: v.to(torch.bfloat16) for k, v in base_weights(tiny).items()}
    ours = LlamaModel(cfg, weights)
    stored = load_file(str(adapter.store_path / "tensors.safetensors"))
    lora = {k: v.to(torch.bfloat16) for k, v in stored.items()}
    bound_ = adapter.bind(lora, ours)
    merged_weights = dict(weights)
    for name, a in lora.items():
        if ".lora_A." in name:
            base = name.replace(".lora_A.weight", ".weight")
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            merged_weights[base] = (
                weights[base].float() + adapter.config.scale * (b.float() @ a.float())
            ).to(torch.bfloat16)
    got = prefill(ours, PROMPTS[0], LoraBatch.build([bound_], [len(PROMPTS[0])]))
    want = prefill(LlamaModel(cfg, merged_weights), PROMPTS[0], None)
    # Rounding to bf16 differs between the two (merged weights are rounded once more), and these
    # random weights give logits up to ~30: compare at bf16 tolerance of the logits' scale, and
    # against fp32 the unmerged path must be no less exact than the merged one.
    exact = prefill(merged(tiny, adapter), PROMPTS[0], None)
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.05 * float(exact.abs().max()))
    assert (got - exact).abs().max() <= 1.5 * (want - exact).abs().max()


def test_a_batch_mixing_adapters_gives_each_row_its_own_result(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter]
) -> None:
    a, b = (x.adapter_id for x in adapters)
    mixed = engine(tiny, with_adapters(tiny, adapters))
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    got = mixed.generate(prompts, GREEDY, [a, b, None, a])
    want = [
        engine(tiny, merged(tiny, adapters[0])).generate([PROMPTS[0]], GREEDY)[0].output_ids,
        engine(tiny, merged(tiny, adapters[1])).generate([PROMPTS[1]], GREEDY)[0].output_ids,
        engine(tiny, with_adapters(tiny, [])).generate([PROMPTS[0]], GREEDY)[0].output_ids,
        engine(tiny, merged(tiny, adapters[0])).generate([PROMPTS[1]], GREEDY)[0].output_ids,
    ]
    assert [s.output_ids for s in got] == want
    assert want[0] != want[2]  # adapter and base disagree on the same prompt


def test_prefix_cache_never_hands_one_adapter_anothers_kv(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter]
) -> None:
    a = adapters[1].adapter_id  # adapts k and v: its KV differs from the base's
    eng = engine(tiny, with_adapters(tiny, adapters))
    eng.generate([PROMPTS[0]], GREEDY)  # the base's blocks of this prompt are now cached
    after = eng.generate([PROMPTS[0]], GREEDY, [a])[0]
    alone = engine(tiny, with_adapters(tiny, adapters)).generate([PROMPTS[0]], GREEDY, [a])[0]
    assert after.cached_tokens == 0
    assert after.output_ids == alone.output_ids


def test_an_unknown_adapter_is_refused(tiny: RegisteredModel, adapters: list[RegisteredAdapter]) -> None:
    eng = engine(tiny, with_adapters(tiny, adapters))
    with pytest.raises(ValueError, match="no adapter"):
        eng.add_request(PROMPTS[0], GREEDY, adapter="nope")


def test_lora_batch_groups_rows_by_adapter(tiny: RegisteredModel, adapters: list[RegisteredAdapter]) -> None:
    model = with_adapters(tiny, adapters)
    a, b = (model.adapters[x.adapter_id] for x in adapters)
    assert LoraBatch.build([None, None], [3, 1]) is None
    one = LoraBatch.build([a, a], [3, 1])
    assert one is not None and one.groups[0][1] is None  # one adapter for every row: no gather
    mixed = LoraBatch.build([a, None, b, a], [2, 1, 3, 1])
    assert mixed is not None
    rows = {ad.key: r.tolist() for ad, r in mixed.groups if r is not None}
    assert rows == {a.key: [0, 1, 6], b.key: [3, 4, 5]}


def test_registered_adapter_tensors_are_dynamic(adapters: list[RegisteredAdapter], tmp_path: Path) -> None:
    for adapter in adapters:
        manifest = adapter.manifest()
        assert manifest.tensors and all(not t.static for t in manifest.tensors)
        assert all(".lora_" in t.name and t.name.startswith("model.layers.") for t in manifest.tensors)
