"""LoRA adapter registration, and adapters held in a real pool: base once + each adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.lora_files import write_adapter
from gpu_pool.client import PoolClient
from gpu_pool.planner.regions import align_up
from runtime.adapters import RegisteredAdapter, register_adapter
from runtime.engine.sampling import SamplingParams
from runtime.errors import RegistrationError, UnknownSourceError
from runtime.instance import AdapterTemplate, bind, load_adapters, load_template
from runtime.models.lora import MODULES, LoraError
from runtime.openai_api import RequestError
from runtime.registry import RegisteredModel, register
from runtime.sources import SourceRoots
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters-home")


@pytest.fixture(scope="module")
def tiny(home: Path) -> RegisteredModel:
    write_tiny_gguf(home / "tiny.gguf", hf_weights(3))
    return register(str(home / "tiny.gguf"), "float32", home=home)


@pytest.fixture(scope="module")
def adapters(tiny: RegisteredModel, home: Path) -> list[RegisteredAdapter]:
    qv = write_adapter(home / "src" / "qv", tiny.config, seed=1, std=0.2)
    every = write_adapter(home / "src" / "all", tiny.config, seed=2, rank=4, targets=tuple(MODULES), std=0.2)
    return [register_adapter(str(d), "float32", home=home) for d in (qv, every)]


@pytest.fixture
def pool(tiny: RegisteredModel, tmp_path: Path) -> Iterator[PoolProcess]:
    # The models directory holds the base's store entry and, under adapters/, the adapters'.
    p = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    try:
        yield p
    finally:
        p.stop()


def aligned(manifest: object, alignment: int) -> int:
    """Bytes the pool holds for ``manifest``'s tensors, placed at ``alignment`` (the pool's)."""
    return sum(align_up(t.nbytes, alignment) for t in manifest.tensors)  # type: ignore[attr-defined]


def test_registration_is_idempotent_and_every_tensor_dynamic(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter], home: Path
) -> None:
    again = register_adapter(adapters[0].record["source"], "float32", home=home)
    assert again.adapter_id == adapters[0].adapter_id and again.directory == adapters[0].directory
    assert adapters[0].adapter_id != adapters[1].adapter_id
    for a in adapters:
        assert all(not t.static for t in a.manifest().tensors)
        assert a.directory.parent == tiny.directory.parent / "adapters"  # readable by sandboxed workers
    bf16 = register_adapter(adapters[0].record["source"], "bfloat16", home=home)
    assert {t.dtype for t in bf16.manifest().tensors} == {"bfloat16"}


def test_sources_outside_the_roots_read_as_missing(home: Path, tmp_path: Path, tiny: RegisteredModel) -> None:
    inside = write_adapter(home / "src" / "roots", tiny.config, seed=5)
    roots = SourceRoots((home.resolve() / "src" / "roots",))
    register_adapter(str(inside), "float32", home=tmp_path / "h", roots=roots)
    outside = SourceRoots((tmp_path.resolve(),))
    with pytest.raises(UnknownSourceError) as refused:
        register_adapter(str(inside), "float32", home=tmp_path / "h", roots=outside)
    with pytest.raises(UnknownSourceError) as missing:
        register_adapter(str(tmp_path / "nope"), "float32", home=tmp_path / "h", roots=outside)
    nope = str(tmp_path / "nope")
    assert str(refused.value).replace(str(inside), "X") == str(missing.value).replace(nope, "X")
    with pytest.raises(UnknownSourceError, match="PEFT directory"):
        register_adapter(f"gguf:{home / 'tiny.gguf'}", "float32", home=tmp_path / "h")
    with pytest.raises(UnknownSourceError, match=r"adapter_config\.json"):
        register_adapter(str(tmp_path), "float32", home=tmp_path / "h")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"target_modules": ["lm_head"]}, "not Llama projections"),
        ({"r": 0}, "r must be"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_unsupported_adapter_configs_are_refused(
    tiny: RegisteredModel, tmp_path: Path, patch: dict[str, object], message: str
) -> None:
    d = write_adapter(tmp_path / "bad", tiny.config, seed=3)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(RegistrationError, match=message):
        register_adapter(str(d), "float32", home=tmp_path / "h")


def test_an_adapter_for_another_base_does_not_bind(tiny: RegisteredModel, tmp_path: Path) -> None:
    wider = {**tiny.config, "hidden_size": 2 * int(tiny.config["hidden_size"])}
    other = register_adapter(str(write_adapter(tmp_path / "other", wider, seed=4)), "float32", home=tmp_path)
    template = load_template(tiny.directory)
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent, tmp_path / "models"))
    try:
        with PoolClient(pool.socket_path) as client, pytest.raises(LoraError, match="this base needs"):
            bind(template, client, 64, adapters=load_adapters((("x", str(other.directory)),)))
    finally:
        pool.stop()


def test_an_adapter_for_another_base_is_refused_at_registration_for_that_base(
    tiny: RegisteredModel, tmp_path: Path
) -> None:
    # Deploys register with the base's config: a function whose every instance would fail
    # to start (the bind above) is a 400 at deploy, not a 503 on every request.
    wider = {**tiny.config, "hidden_size": 2 * int(tiny.config["hidden_size"])}
    source = str(write_adapter(tmp_path / "other", wider, seed=4))
    with pytest.raises(RegistrationError, match="this base needs"):
        register_adapter(source, "float32", home=tmp_path, base_config=tiny.config)
    # The same adapter fits the base it was made for (registered once: the check reruns).
    assert register_adapter(source, "float32", home=tmp_path, base_config=wider).config.rank == 8
    fits = str(write_adapter(tmp_path / "fits", tiny.config, seed=5, rank=4, targets=tuple(MODULES)))
    register_adapter(fits, "float32", home=tmp_path, base_config=tiny.config)


def test_two_functions_on_one_base_hold_it_once_plus_each_adapter(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter], pool: PoolProcess
) -> None:
    """TIDAL's acceptance: resident bytes = base once + every adapter, read from the pool's stats."""
    template = load_template(tiny.directory)
    a, b = (AdapterTemplate(n, x, x.manifest()) for n, x in zip(("fr", "pirate"), adapters, strict=True))
    with PoolClient(pool.socket_path) as one, PoolClient(pool.socket_path) as two:
        first = bind(template, one, 64, adapters=(a,))
        second = bind(template, two, 64, adapters=(b,))
        stats = one.stats()
        base, fr, pirate = (aligned(m, one.alignment) for m in (template.manifest, a.manifest, b.manifest))
        assert stats["resident_bytes"] == base + fr + pirate
        assert stats["models"][tiny.model_id]["resident_bytes"] == template.manifest.nbytes
        assert stats["bytes_loaded"] == template.manifest.nbytes + a.manifest.nbytes + b.manifest.nbytes
        # Each instance serves its own adapter per request, and the base without one.
        assert first.adapters == {"fr": adapters[0].adapter_id}
        assert first.adapter("f:fr") == adapters[0].adapter_id and first.adapter("f") is None
        with pytest.raises(RequestError, match="no adapter 'pirate'"):
            first.adapter("f:pirate")
        # The gateway routes "f:x:fr" to function f (up to the first ":"): the rest, "x:fr",
        # names the adapter, not whatever follows the last ":".
        with pytest.raises(RequestError, match="no adapter 'x:fr'"):
            first.adapter("f:x:fr")
        outs = [
            first.engine.generate([[5, 9, 33, 71]], GREEDY, [first.adapter("f:fr")])[0].output_ids,
            second.engine.generate([[5, 9, 33, 71]], GREEDY, [second.adapter("g:pirate")])[0].output_ids,
            second.engine.generate([[5, 9, 33, 71]], GREEDY)[0].output_ids,
        ]
        assert len({tuple(o) for o in outs}) == 3
        first.engine.close()
        one.close()  # the first instance ends: its adapter goes with its session, the base stays
        assert two.stats()["resident_bytes"] == base + pirate
        second.engine.close()


def test_a_standby_style_rebind_acquires_adapters_again(
    tiny: RegisteredModel, adapters: list[RegisteredAdapter], pool: PoolProcess
) -> None:
    """Adapters are session-private: a released session holds none, the next acquire loads them."""
    template = load_template(tiny.directory)
    pair = (("fr", str(adapters[0].directory)),)
    with PoolClient(pool.socket_path) as client:
        binding = bind(template, client, 64, adapters=load_adapters(pair))
        client.release()
        assert client.stats()["resident_bytes"] == aligned(template.manifest, client.alignment)
        binding.attach_adapters(client, load_adapters(pair))
        both = aligned(template.manifest, client.alignment) + aligned(
            adapters[0].manifest(), client.alignment
        )
        assert client.stats()["resident_bytes"] == both
        binding.engine.close()
