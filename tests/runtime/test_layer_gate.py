"""The model waits per layer for a progressive acquire's bytes (TIDAL §5.2)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from gpu_pool.readiness import READY, Readiness
from gpu_pool.spawn import running_pool
from runtime.instance import bind, load_template
from runtime.models.layer_gate import LayerGate, stage_groups
from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.registry import models_dir, register
from tests.conftest import wait_until
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

LAYERS = 6


def _model_inputs(tied: bool = False) -> tuple[LlamaConfig, dict[str, torch.Tensor], Batch, torch.Tensor]:
    weights = {k: torch.from_numpy(v) for k, v in hf_weights(layers=LAYERS).items()}
    if tied:  # the LM head is the embedding table
        del weights["lm_head.weight"]
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    heads, kv_heads, inter = 4, 2, weights["model.layers.0.mlp.gate_proj.weight"].shape[0]
    cfg = LlamaConfig(vocab, hidden, inter, LAYERS, heads, kv_heads, hidden // heads, 1e-6, 10000.0,
                      "lm_head.weight" not in weights, False, 128)  # fmt: skip
    n = 5
    pos = torch.arange(n)
    batch = Batch(pos % vocab, pos, pos, [n], [n], torch.zeros(1, 1, dtype=torch.int64))
    kv = torch.zeros(1, *cfg.kv_block_shape(16))
    return cfg, weights, batch, kv


@pytest.mark.parametrize("kernels", ["off", None])  # the torch path; the CPU kernels where built
def test_forward_waits_for_each_layer_before_reading_it(kernels: str | None) -> None:
    cfg, weights, batch, kv = _model_inputs()
    expected = LlamaModel(cfg, weights, cpu_kernels=kernels).forward(batch, kv.clone())
    names = list(weights)
    ends = stage_groups(names, LAYERS, 4096)
    assert ends is not None and len(ends) == LAYERS + 2  # embeddings, each layer, norm (+ head)
    # The bytes arrive as the daemon writes them: NaN until a group is copied, then signalled.
    live = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    read_fd, write_fd = os.pipe()
    readiness = Readiness(read_fd, ends, "tiny")
    gate = LayerGate(readiness, names, LAYERS)
    model = LlamaModel(cfg, live, cpu_kernels=kernels, gate=gate)

    def loader() -> None:
        start = 0
        for end in ends:
            time.sleep(0.01)
            for name in names[start:end]:
                live[name].copy_(weights[name])
            os.write(write_fd, READY)
            start = end
        os.close(write_fd)

    thread = threading.Thread(target=loader)
    thread.start()
    got = model.forward(batch, kv.clone())
    thread.join()
    assert torch.equal(got, expected)
    assert gate.waited_s > 0 and readiness.done
    model.forward(batch, kv.clone())
    assert model.gate is None  # all in: the next forward checks nothing


class _TableLast:
    """A model over NaN weights in access order v2 (the embedding table last) that the test
    loads group by group (:meth:`release`), as the daemon would, with its gate."""

    def __init__(
        self,
        tmp_path: Path,
        cfg: LlamaConfig,
        weights: dict[str, torch.Tensor],
        kernels: str | None,
        device: str = "cpu",
    ) -> None:
        from gpu_pool import store
        from runtime.models.embedding_rows import EMBED, EmbeddingRows

        self.names = [n for n in weights if n != EMBED] + [EMBED]
        manifest = store.write(tmp_path / "entry", {n: weights[n] for n in self.names})
        ends = stage_groups(self.names, LAYERS, 4096)
        assert ends is not None
        self.ends, self.released, self.weights = ends, 0, weights
        self.live = {k: torch.full_like(v, float("nan"), device=device) for k, v in weights.items()}
        read_fd, self.write_fd = os.pipe()
        self.readiness = Readiness(read_fd, ends, "tiny")
        rows = EmbeddingRows.of(manifest)
        self.gate = LayerGate(
            self.readiness, self.names, LAYERS, embedding=rows, tied=cfg.tie_word_embeddings
        )
        self.model = LlamaModel(cfg, self.live, False, kernels, gate=self.gate)

    def release(self, groups: int) -> None:
        for _ in range(groups):
            start = self.ends[self.released - 1] if self.released else 0
            for name in self.names[start : self.ends[self.released]]:
                self.live[name].copy_(self.weights[name])
            os.write(self.write_fd, READY)
            self.released += 1

    def release_later(self, seconds: float) -> threading.Thread:
        """Every group still out (the table), ``seconds`` from now."""

        def load() -> None:
            time.sleep(seconds)
            self.release(len(self.ends) - self.released)

        thread = threading.Thread(target=load)
        thread.start()
        return thread


@pytest.mark.parametrize("kernels", ["off", None])  # the torch path; the CPU kernels where built
def test_a_tied_head_waits_for_the_table_that_loads_last(tmp_path: Path, kernels: str | None) -> None:
    cfg, weights, batch, kv = _model_inputs(tied=True)
    assert cfg.tie_word_embeddings
    expected = LlamaModel(cfg, weights, cpu_kernels=kernels).forward(batch, kv.clone())
    load = _TableLast(tmp_path, cfg, weights, kernels)
    load.release(len(load.ends) - 1)  # every layer, the final norm: not the table (the head)
    thread = load.release_later(0.05)
    got = load.model.forward(batch, kv.clone())
    thread.join()
    assert torch.equal(got, expected)  # not the NaN of a head read before its bytes
    assert load.gate.rows_read == batch.input_ids.numel() and load.gate.waited_s > 0


@pytest.mark.parametrize("kernels", ["off", None])  # the torch path; the CPU kernels where built
def test_later_forwards_read_their_rows_while_an_untied_table_loads(
    tmp_path: Path, kernels: str | None
) -> None:
    """Two prompts at once (ids at both ends of the table, repeats), then a step where one
    sequence adds a 3-token suffix to its cached context and the other decodes one token."""
    cfg, weights, _, _ = _model_inputs()
    vocab, block = cfg.vocab_size, 16
    kv = torch.zeros(4, *cfg.kv_block_shape(block))
    tables = torch.tensor([[0, 1], [2, 3]])
    ids = torch.tensor([0, vocab - 1, 5, 5, vocab - 1, 0, 7, vocab - 1, 3, 3, 0])  # 7 + 4 tokens
    positions = torch.tensor([*range(7), *range(4)])
    slots = torch.tensor([*range(7), *range(2 * block, 2 * block + 4)])
    prefill = Batch(ids, positions, slots, [7, 4], [7, 4], tables)
    slots = torch.tensor([7, 8, 9, 2 * block + 4])
    step = Batch(
        torch.tensor([vocab - 1, 0, 0, 3]), torch.tensor([7, 8, 9, 4]), slots, [3, 1], [10, 5], tables
    )
    reference, ref_kv = LlamaModel(cfg, weights, cpu_kernels=kernels), kv.clone()
    expected = [reference.forward(b, ref_kv) for b in (prefill, step)]
    load = _TableLast(tmp_path, cfg, weights, kernels)
    load.release(len(load.ends) - 1)  # the table never comes during both forwards
    got = [load.model.forward(b, kv) for b in (prefill, step)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert load.gate.rows_read == 11 + 4 and not load.readiness.done
    load.release(1)
    load.model.forward(step, kv.clone())
    assert load.gate.rows_read == 15 and load.readiness.done  # in: the table's own rows
    load.model.forward(step, kv.clone())
    assert load.model.gate is None


@pytest.mark.gpu
def test_a_cuda_model_reads_its_prompts_rows_from_the_store_file(
    tmp_path: Path, torch_cuda: torch.device
) -> None:
    """The rows are gathered on the host by the batch's host ids: CUDA ids indexing host rows
    raised, the gate swallowed it and layer 0 waited for the whole model (the table is last)."""
    cfg, weights, batch, kv = _model_inputs()
    on_gpu = {k: v.to(torch_cuda) for k, v in weights.items()}
    expected = LlamaModel(cfg, on_gpu, False).forward(batch, kv.to(torch_cuda)).cpu()
    load = _TableLast(tmp_path, cfg, weights, None, device=str(torch_cuda))
    load.release(len(load.ends) - 1)
    thread = load.release_later(0.5)  # a forward that waits for the table still ends
    got = load.model.forward(batch, kv.to(torch_cuda)).cpu()
    thread.join()
    torch.testing.assert_close(got, expected)
    assert load.gate.rows_read == batch.input_ids.numel()


def test_a_failed_load_fails_the_forward() -> None:
    from gpu_pool.errors import LoadError

    cfg, weights, batch, kv = _model_inputs()
    read_fd, write_fd = os.pipe()
    names = list(weights)
    ends = stage_groups(names, LAYERS, 4096)
    assert ends is not None
    os.write(write_fd, READY * 2 + b"E")
    os.close(write_fd)
    model = LlamaModel(
        cfg, weights, cpu_kernels="off", gate=LayerGate(Readiness(read_fd, ends), names, LAYERS)
    )
    with pytest.raises(LoadError):
        model.forward(batch, kv)


@pytest.mark.slow
def test_progressive_instance_generates_what_a_loaded_one_does(tmp_path: Path) -> None:
    from gpu_pool.client import PoolClient

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf_weights(layers=LAYERS))
    home = tmp_path / "home"
    model = register(str(path), "float32", home=home)
    template = load_template(model.directory)
    prompt = template.tokenizer.encode("the then in", add_special_tokens=False).ids
    from runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    with running_pool(str(tmp_path / "pool.sock"), "64MiB", store_roots=(models_dir(home),)) as pool:
        for progressive in (True, False, True):
            with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:
                # The previous session's close is handled by the daemon on its own: until then
                # its pins hold the weights, and an evict would leave them resident.
                wait_until(lambda: admin.stats()["pinned_bytes"] == 0, 30.0)
                admin.evict()
            with PoolClient(pool.socket_path) as client:
                binding = bind(template, client, 16, progressive=progressive)
                assert binding.acquire_report.bytes_loaded == model.manifest().nbytes
                gate = binding.engine.runner.model.gate
                assert (gate is not None) == progressive
                outputs.append(binding.engine.generate([prompt], params)[0].output_ids)
                binding.engine.close()
    assert outputs[0] == outputs[1] == outputs[2]
