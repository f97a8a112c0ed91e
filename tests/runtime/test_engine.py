"""The engine on a tiny registered model whose weights and KV blocks live in a real pool."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from gpu_pool.client import PoolClient
from runtime.engine.build import PoolKV, PrivateKV, build_engine
from runtime.engine.detokenize import Detokenizer, special_ids
from runtime.engine.engine import Engine, EngineConfig, StepOutput
from runtime.engine.kv_storage import kv_block_bytes, private_kv
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SchedulerConfig, SloUnattainable
from runtime.engine.sequence import FinishReason
from runtime.mesh.admission import InstanceView
from runtime.mesh.gate import Gate
from runtime.mesh.grant_server import DeviceGrants
from runtime.mesh.slo import Slo
from runtime.mesh.state_page import PAGE_BYTES, StatePage
from runtime.mesh.time_table import TimeTable
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.registry import RegisteredModel
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import register_tiny

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    return register_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def pool(tiny: RegisteredModel, tmp_path: Path) -> Iterator[PoolProcess]:
    p = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.store_path,))
    try:
        yield p
    finally:
        p.stop()


def make_engine(
    tiny: RegisteredModel,
    client: PoolClient,
    refill: int = 8,
    max_seqs: int = 32,
    prefix_caching: bool = True,
    prefix_model: str | None = None,
) -> Engine:
    config = LlamaConfig.from_hf(tiny.config)
    model = LlamaModel(config, client.acquire(tiny.manifest()))
    block_bytes = kv_block_bytes(config, BLOCK, torch.float32)
    tok = Tokenizer.from_file(str(tiny.directory / "tokenizer.json"))
    return build_engine(
        model,
        tok,
        {2},
        PoolKV(client, block_bytes, prefix_model),
        torch.float32,
        EngineConfig(BLOCK, refill, SchedulerConfig(max_num_seqs=max_seqs), prefix_caching),
    )


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [
        torch.randint(3, 250, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_staggered_concurrent_requests_match_solo_runs(tiny: RegisteredModel, pool: PoolProcess) -> None:
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        solo = [engine.generate([p], GREEDY)[0].output_ids for p in prompts(16)]
        ids: list[int] = []
        pending = prompts(16)
        while pending or engine.has_unfinished():
            for _ in range(2):  # two new arrivals per step boundary
                if pending:
                    ids.append(engine.add_request(pending.pop(0), GREEDY))
            engine.step()
        assert [engine.seqs[i].output_ids for i in ids] == solo
        engine.close()


def test_kv_blocks_the_pool_rounds_past_the_profiles_256_bytes_are_numbered_as_it_places_them(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """A CPU pool places at 512 bytes (direct reads); a profile rounds a block to 256. A block
    of 768 bytes is 1024 in the pool: the engine must number and view blocks at that size."""
    config = LlamaConfig.from_hf(tiny.config)
    odd = 3  # tokens per block: 768 bytes of float32 KV for the tiny model
    block_bytes = kv_block_bytes(config, odd, torch.float32)
    with PoolClient(pool.socket_path) as client:
        assert block_bytes % client.alignment, "the case needs a block the pool rounds up"
        model = LlamaModel(config, client.acquire(tiny.manifest()))
        tok = Tokenizer.from_file(str(tiny.directory / "tokenizer.json"))
        engine = build_engine(
            model,
            tok,
            {2},
            PoolKV(client, block_bytes),
            torch.float32,
            EngineConfig(odd, 8, SchedulerConfig()),
        )
        reference = make_engine(tiny, client)
        for p in prompts(4):
            assert engine.generate([p], GREEDY)[0].output_ids == reference.generate([p], GREEDY)[0].output_ids
        engine.close()
        reference.close()


def test_kv_bytes_follow_live_tokens_and_all_return(tiny: RegisteredModel, pool: PoolProcess) -> None:
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client, refill=1)
        block_bytes = kv_block_bytes(LlamaConfig.from_hf(tiny.config), BLOCK, torch.float32)
        for p in prompts(5):
            engine.add_request(p, GREEDY)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            live = [s for s in engine.scheduler.running]
            needed = sum(-(-s.num_cached // BLOCK) for s in live)
            held_by_seqs = sum(len(s.block_table) for s in live)
            assert held_by_seqs == needed
            assert (
                client.stats()["kv_bytes"]
                == (engine.blocks.num_held + len(engine.blocks.free) + len(engine.blocks.evictable))
                * block_bytes
            )
        assert steps > 5
        engine.close()
        assert client.stats()["kv_bytes"] == 0


def test_nearly_full_pool_preempts_and_still_completes(tiny: RegisteredModel, tmp_path: Path) -> None:
    config = LlamaConfig.from_hf(tiny.config)
    block_bytes = kv_block_bytes(config, BLOCK, torch.float32)
    ps = prompts(8)
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy_pool = PoolProcess(tmp_path / "a.sock", "8MiB", store=(tiny.store_path,))
    try:
        with PoolClient(roomy_pool.socket_path) as roomy:
            reference = make_engine(tiny, roomy)
            expected = [reference.generate([p], long)[0].output_ids for p in ps]
    finally:
        roomy_pool.stop()
    pool = PoolProcess(tmp_path / "b.sock", "2MiB", store=(tiny.store_path,))
    try:
        with PoolClient(pool.socket_path) as client, PoolClient(pool.socket_path) as hog:
            engine = make_engine(tiny, client, refill=1)
            # Leave room for only 14 blocks: far fewer than 8 sequences of ~30 tokens need.
            free = client.stats()["free_bytes"]
            hog.kv_alloc(max(1, free // block_bytes - 14), block_bytes, aligned=True)
            out = engine.generate(ps, long)
            assert [s.output_ids for s in out] == expected
            assert engine.scheduler.num_preemptions > 0
            assert all(s.finish_reason is FinishReason.LENGTH for s in out)
            engine.close()
            assert client.stats()["kv_bytes"] == hog.stats()["kv_bytes"]  # only the hog's remain
    finally:
        pool.stop()


def test_contiguous_mode_gives_the_same_tokens(tiny: RegisteredModel, pool: PoolProcess) -> None:
    config = LlamaConfig.from_hf(tiny.config)
    with PoolClient(pool.socket_path) as client:
        paged = make_engine(tiny, client)
        expected = [s.output_ids for s in paged.generate(prompts(4), GREEDY)]
        tok = Tokenizer.from_file(str(tiny.directory / "tokenizer.json"))
        model = LlamaModel(config, client.acquire(tiny.manifest()))
        contiguous = build_engine(model, tok, {2}, PrivateKV(64), torch.float32, EngineConfig(BLOCK))
        assert [s.output_ids for s in contiguous.generate(prompts(4), GREEDY)] == expected


def test_sampling_is_seeded_and_stop_strings_cut_text(tiny: RegisteredModel, pool: PoolProcess) -> None:
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
        a = engine.generate([prompts(1)[0]], params)[0]
        b = engine.generate([prompts(1)[0]], params)[0]
        assert a.output_ids == b.output_ids
        text = engine.text(a.seq_id)
        assert text
        stop = text[len(text) // 2 : len(text) // 2 + 2] or text[:1]
        c = engine.generate([prompts(1)[0]], SamplingParams(**{**_fields(params), "stop": (stop,)}))[0]
        assert c.finish_reason is FinishReason.STOP
        assert stop not in engine.text(c.seq_id)
        assert text.startswith(engine.text(c.seq_id))


def _fields(p: SamplingParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"presence_penalty": 3.0},
        {"stop": ("",)},
    ],
)
def test_invalid_sampling_parameters_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_streaming_deltas_hold_back_partial_utf8(tiny: RegisteredModel, pool: PoolProcess) -> None:
    from runtime.engine.engine import _TextState
    from runtime.engine.sequence import Sequence

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        # The tiny vocabulary is bytes: "é" is two tokens, "🤖" four.
        text_ids = engine.tokenizer.encode("aé🤖b", add_special_tokens=False).ids
        assert len(text_ids) == 8
        seq = Sequence(999, [5], SamplingParams(max_tokens=100))
        engine._text[999] = _TextState(Detokenizer(engine.tokenizer, special_ids(engine.tokenizer)))
        deltas = []
        for t in text_ids:
            seq.output_ids.append(t)
            delta, reason = engine._advance_text(seq, t)
            assert "\ufffd" not in delta and reason is None
            deltas.append(delta)
        assert "".join(deltas) == "aé🤖b"
        assert "" in deltas  # some steps had only part of a character


def test_chat_template_renders_generation_prompt(tiny: RegisteredModel) -> None:
    import json

    from runtime.chat import ChatTemplateError, render_chat

    cfg = json.loads((tiny.directory / "tokenizer_config.json").read_text())
    text = render_chat(cfg["chat_template"], [{"role": "user", "content": "hi"}], cfg)
    assert text == "<|im_start|>hi<|im_end|>"
    with pytest.raises(ChatTemplateError):
        render_chat(None, [{"role": "user", "content": "hi"}], cfg)


def test_async_streams_of_concurrent_requests(tiny: RegisteredModel, pool: PoolProcess) -> None:
    import asyncio

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        ps = prompts(3)
        expected = [engine.generate([p], GREEDY)[0].output_ids for p in ps]

        async def consume(p: list[int]) -> tuple[list[int], str, FinishReason | None]:
            ids, text, reason = [], "", None
            async for out in engine.stream(p, GREEDY):
                ids.append(out.token_id)
                text += out.text_delta
                reason = out.finish_reason
            return ids, text, reason

        async def main() -> list[tuple[list[int], str, FinishReason | None]]:
            driver = asyncio.create_task(engine.run_forever())
            try:
                return await asyncio.gather(*(consume(p) for p in ps))
            finally:
                driver.cancel()

        results = asyncio.run(main())
        assert [r[0] for r in results] == expected
        assert all(r[2] is FinishReason.LENGTH for r in results)
        assert all(r[1] == engine.tokenizer.decode(r[0]) for r in results)


def test_repetition_penalties_change_greedy_choices(tiny: RegisteredModel, pool: PoolProcess) -> None:
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        p = prompts(1)[0]
        plain = engine.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].output_ids
        penalized = engine.generate(
            [p], SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
        )[0].output_ids
        assert len(set(penalized)) >= len(set(plain))
        assert penalized != plain or len(set(plain)) == len(plain)


def test_stale_nan_bytes_in_kv_blocks_do_not_leak_into_attention(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    config = LlamaConfig.from_hf(tiny.config)
    ps = prompts(4)
    with PoolClient(pool.socket_path) as client:
        clean = [s.output_ids for s in make_engine(tiny, client).generate(ps, GREEDY)]
    kv, source = private_kv(config, BLOCK, torch.float32, 64)
    kv.fill_(float("nan"))  # what an arena that held other bytes may look like
    with PoolClient(pool.socket_path) as client:
        model = LlamaModel(config, client.acquire(tiny.manifest()))
        tok = Tokenizer.from_file(str(tiny.directory / "tokenizer.json"))
        dirty = Engine(model, tok, kv, source, {2}, EngineConfig(BLOCK))
        assert [s.output_ids for s in dirty.generate(ps, GREEDY)] == clean


def test_earliest_stop_string_wins(tiny: RegisteredModel, pool: PoolProcess) -> None:
    from runtime.engine.engine import _TextState
    from runtime.engine.sequence import Sequence

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        ids = engine.tokenizer.encode("bbabc", add_special_tokens=False).ids
        seq = Sequence(7, [5], SamplingParams(max_tokens=50, stop=("c", "abc")))
        engine._text[7] = _TextState(Detokenizer(engine.tokenizer, special_ids(engine.tokenizer)))
        emitted, reason = "", None
        for t in ids:
            seq.output_ids.append(t)
            delta, reason = engine._advance_text(seq, t)
            emitted += delta
            if reason is not None:
                break
        assert emitted == "bb" and reason is FinishReason.STOP


def private_kv_engine(tiny: RegisteredModel, pool: PoolProcess, num_blocks: int) -> Engine:
    """An engine over pool weights with a private KV of ``num_blocks`` blocks."""
    config = LlamaConfig.from_hf(tiny.config)
    with PoolClient(pool.socket_path) as client:
        model = LlamaModel(config, client.acquire(tiny.manifest()))
    tok = Tokenizer.from_file(str(tiny.directory / "tokenizer.json"))
    return build_engine(model, tok, {2}, PrivateKV(num_blocks), torch.float32, EngineConfig(BLOCK))


def test_a_request_that_can_never_fit_fails_alone(tiny: RegisteredModel, pool: PoolProcess) -> None:
    import asyncio

    from runtime.engine.scheduler import KVCacheExhausted

    engine = private_kv_engine(tiny, pool, 4)  # 16 tokens of KV in all

    async def run() -> tuple[str, list[int]]:
        driver = asyncio.create_task(engine.run_forever())
        try:
            with pytest.raises(KVCacheExhausted) as info:
                async for _ in engine.stream(list(range(3, 30)), GREEDY):  # 27 tokens > 16
                    pass
            small = [
                o.token_id
                async for o in engine.stream([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            ]
            return str(info.value), [t for t in small if t is not None]
        finally:
            driver.cancel()

    message, small = asyncio.run(run())
    assert "KV blocks" in message and len(small) == 4


def test_a_stream_abandoned_early_frees_its_slot_and_blocks(tiny: RegisteredModel, pool: PoolProcess) -> None:
    import asyncio

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)

        async def run() -> None:
            driver = asyncio.create_task(engine.run_forever())
            try:
                stream = engine.stream(prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
                async for _ in stream:
                    break  # the client went away after one token
                await stream.aclose()
                await asyncio.sleep(0.05)
            finally:
                driver.cancel()

        asyncio.run(run())
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.blocks.num_held == 0 and engine.seqs == {}


def test_a_hang_up_stops_every_choice_while_their_streams_are_not_closed(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """The consumer neither closes its streams nor stops reading: the hang-up alone aborts the
    sequences (their blocks and batch slots are freed) and ends each stream with an empty
    last output, long before max_tokens."""
    import asyncio

    from runtime.engine.engine import HangUp

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        hang_up = HangUp()
        outputs: list[list[StepOutput]] = [[], []]

        async def read(i: int) -> None:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            async for out in engine.stream(prompts(1)[0], params, hang_up=hang_up):
                outputs[i].append(out)
                if len(outputs[0]) == 2 and i == 0:
                    hang_up()  # the client went away after two tokens of the first choice

        async def run() -> None:
            driver = asyncio.create_task(engine.run_forever())
            try:
                await asyncio.wait_for(asyncio.gather(read(0), read(1)), 30)
                late = [o async for o in engine.stream([5, 6, 7], GREEDY, hang_up=hang_up)]
                assert late == []  # a stream started after the hang-up never runs
            finally:
                driver.cancel()

        asyncio.run(run())
        for out in outputs:
            assert len(out) < 10 and out[-1].token_id is None and out[-1].finish_reason is FinishReason.STOP
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.blocks.num_held == 0 and engine.seqs == {}


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    import asyncio

    from runtime.engine.scheduler import EngineError

    engine = private_kv_engine(tiny, pool, 16)
    # A seed torch.Generator cannot take: sampling raises inside the step (a real failure).
    poisoned = SamplingParams(max_tokens=4, temperature=1.0, seed=2**70)

    async def run() -> tuple[str, list[int]]:
        driver = asyncio.create_task(engine.run_forever())
        try:
            with pytest.raises(EngineError) as info:
                async for _ in engine.stream([5, 6, 7], poisoned):
                    pass
            healthy = [
                o.token_id
                async for o in engine.stream([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            ]
            return str(info.value), [t for t in healthy if t is not None]
        finally:
            driver.cancel()

    message, healthy = asyncio.run(run())
    assert "the engine failed" in message and len(healthy) == 4
    assert not engine.scheduler.has_work() and engine.blocks.num_held == 0  # all blocks came back


def test_an_ended_engine_fails_its_requests_and_refuses_new_ones(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """An instance that ended under its engine (its pool died: WorkerState.release): every
    request in it gets one error, and one added afterwards fails at once instead of waiting
    for steps that no driver will run."""
    import asyncio

    from runtime.engine.scheduler import EngineError

    engine = private_kv_engine(tiny, pool, 16)

    async def run() -> tuple[list[str], str]:
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        streams = [engine.stream([5, 6, 7], params) for _ in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]  # added and waiting
        await asyncio.sleep(0)
        engine.end("the pool went away")
        errors = []
        for first in firsts:
            with pytest.raises(EngineError) as info:
                await first
            errors.append(str(info.value))
        with pytest.raises(EngineError) as late:
            await anext(engine.stream([5, 6, 7], params))
        return errors, str(late.value)

    errors, late = asyncio.run(asyncio.wait_for(run(), 30))
    assert errors == ["the pool went away"] * 2 and late == "the pool went away"
    assert not engine.scheduler.has_work()


def test_a_pool_that_dies_mid_decode_fails_every_request_once(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """A decode step whose KV fetch finds the pool dead (SIGKILLed here) fails every request
    with one error: none is lost between the scheduler's queues (its stream would wait forever)."""
    import asyncio
    import signal

    from runtime.engine.scheduler import EngineError

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client, refill=1)  # a block fetch at every block boundary

        async def run() -> list[str]:
            driver = asyncio.create_task(engine.run_forever())
            params = SamplingParams(max_tokens=60, ignore_eos=True)

            async def consume(i: int) -> str:
                n = 0
                try:
                    async for _ in engine.stream([5, 6, 7 + i], params):
                        n += 1
                        if n == 3 and pool.proc.poll() is None:
                            pool.proc.send_signal(signal.SIGKILL)
                            pool.proc.wait()
                except EngineError as exc:
                    return f"error: {exc}"
                return f"finished after {n}"

            try:
                return await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(4))), 30)
            finally:
                driver.cancel()

        results = asyncio.run(run())
    assert all(r.startswith("error: the engine failed") for r in results), results
    assert not engine.scheduler.has_work()
    assert all(s.status.name == "FINISHED" for s in engine.seqs.values())


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    system = list(range(40, 40 + 5 * BLOCK + 2))  # 22 tokens: 5 full blocks
    ps = [*([*system, 7 + i, 9] for i in range(4)), system]
    with PoolClient(pool.socket_path) as client:
        plain = make_engine(tiny, client, prefix_caching=False)
        expected = [plain.generate([p], GREEDY)[0].output_ids for p in ps]
        plain.close()
        engine = make_engine(tiny, client)
        first = engine.generate([ps[0]], GREEDY)[0]
        assert first.cached_tokens == 0 and first.output_ids == expected[0]
        rest = engine.generate(ps[1:], GREEDY)  # admitted together: all hit the first's blocks
        assert [s.output_ids for s in rest] == expected[1:]
        assert [s.cached_tokens for s in rest] == [5 * BLOCK] * 4
        assert engine.blocks.stats.hit_tokens == 4 * 5 * BLOCK
        engine.close()
        assert client.stats()["kv_bytes"] == 0


def test_streamed_outputs_report_cached_tokens(tiny: RegisteredModel, pool: PoolProcess) -> None:
    import asyncio

    prompt = list(range(60, 60 + 3 * BLOCK + 1))
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)

        async def main() -> tuple[list[int], list[int]]:
            driver = asyncio.create_task(engine.run_forever())
            try:
                cold = [o.cached_tokens async for o in engine.stream(prompt, GREEDY)]
                warm = [o.cached_tokens async for o in engine.stream(prompt, GREEDY)]
                return cold, warm
            finally:
                driver.cancel()

        cold, warm = asyncio.run(main())
        assert set(cold) == {0} and set(warm) == {3 * BLOCK}
        engine.close()


def test_a_later_instance_restores_the_prefix_a_finished_one_published(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    system = list(range(80, 80 + 6 * BLOCK + 1))
    first_prompt, later_prompt = [*system, 5, 6], [*system, 9]  # 6 full blocks in common
    with PoolClient(pool.socket_path) as client:
        plain = make_engine(tiny, client, prefix_caching=False)
        expected = [plain.generate([p], GREEDY)[0].output_ids for p in (first_prompt, later_prompt)]
        plain.close()
    with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:  # the agent's tickets
        tickets = [admin.grant(64 << 20, prefix_scope="default/chat") for _ in range(2)]
    with PoolClient(pool.socket_path, ticket=tickets[0]) as client:  # an instance that ends after one request
        first = make_engine(tiny, client, prefix_model=tiny.model_id)
        done = first.generate([first_prompt], GREEDY)[0]
        assert done.cached_tokens == 0 and done.output_ids == expected[0]
        assert client.stats()["prefix_blocks"] == 6  # its full prompt blocks, published once
        first.generate([first_prompt], GREEDY)  # a local hit: nothing published again
        assert client.stats()["prefix_blocks_published"] == 6
    with PoolClient(pool.socket_path, ticket=tickets[1]) as client:  # a new instance of the same function
        later = make_engine(tiny, client, prefix_model=tiny.model_id)
        done = later.generate([later_prompt], GREEDY)[0]
        assert done.cached_tokens == 6 * BLOCK and later.blocks.stats.restored_tokens == 6 * BLOCK
        assert done.output_ids == expected[1]  # the same tokens as computing the prefix
        again = later.generate([later_prompt], GREEDY)[0]  # now a local hit, no pool call
        assert again.cached_tokens == 6 * BLOCK and later.blocks.stats.restored_tokens == 6 * BLOCK
        later.close()
    with PoolClient(pool.socket_path) as client:  # prefix sharing off: nothing restored
        alone = make_engine(tiny, client)
        assert alone.generate([later_prompt], GREEDY)[0].cached_tokens == 0


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    seq_id = engine.add_request(prompt, params)
    outs: list[StepOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.seq_id == seq_id]
    return outs


def test_prompt_logprobs_match_the_logprobs_of_generating_those_tokens(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """Echo's prompt log-probabilities (every prompt position's logits, asked for per request)
    agree with the log-probabilities the same tokens had when generated, even when the prompt's
    prefix is in the prefix cache (such a request computes its prompt whole)."""
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        prompt = prompts(1)[0] * 3  # several full blocks: cacheable
        outs = _run(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2))
        generated = [o.token_id for o in outs]
        assert all(o.logprob is not None and len(o.logprob.top) == 2 for o in outs)
        assert all(o.logprob is not None and o.logprob.top[0][0] == o.token_id for o in outs)  # greedy
        assert outs[0].prompt_logprobs is None  # not asked: not computed
        echo = _run(
            engine, prompt + generated[:3], SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=2)
        )
        lps = echo[0].prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) + 3 and lps[0] is None
        for got, want in zip(lps[-3:], outs[:3], strict=True):
            assert got is not None and want.logprob is not None
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob.logprob, abs=1e-4)
        assert echo[0].token_id == generated[3]  # the continuation is unchanged


def test_min_tokens_holds_off_eos_and_stop_strings(tiny: RegisteredModel, pool: PoolProcess) -> None:
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        prompt = prompts(1)[0]
        forced_eos = SamplingParams(max_tokens=10, logit_bias=((2, 100.0),))
        assert len(_run(engine, prompt, forced_eos)) == 1  # EOS at once
        outs = _run(engine, prompt, SamplingParams(**{**_fields(forced_eos), "min_tokens": 4}))
        assert [o.token_id == 2 for o in outs] == [False] * 4 + [True]
        assert outs[-1].finish_reason is FinishReason.STOP
        free = SamplingParams(max_tokens=8, ignore_eos=True)
        text = "".join(o.text_delta for o in _run(engine, prompt, free))
        stop = SamplingParams(**{**_fields(free), "stop": (text[:1],)})
        assert len(_run(engine, prompt, stop)) < 8
        held = _run(engine, prompt, SamplingParams(**{**_fields(stop), "min_tokens": 8}))
        assert len(held) == 8 and "".join(o.text_delta for o in held) == text


@pytest.mark.parametrize("n", [1, 3])
def test_merged_choice_streams_closed_early_abort_every_choice(
    tiny: RegisteredModel, pool: PoolProcess, n: int
) -> None:
    """``n`` choices are ``n`` sequences: a client that goes away frees them all at once."""
    import asyncio

    from runtime.openai_response import merge

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)

        async def run() -> set[int]:
            driver = asyncio.create_task(engine.run_forever())
            try:
                params = SamplingParams(max_tokens=100, temperature=1.0, seed=1, ignore_eos=True)
                merged = merge([engine.stream(prompts(1)[0], params) for _ in range(n)])
                seen = set()
                async for i, _ in merged:
                    seen.add(i)
                    if len(seen) == n:
                        break
                await merged.aclose()  # type: ignore[attr-defined]
                assert not engine.scheduler.running and not engine.scheduler.waiting
                return seen
            finally:
                driver.cancel()

        assert asyncio.run(run()) == set(range(n))
        assert engine.blocks.num_held == 0 and engine.seqs == {}


def test_watermark_kv_scaling_grows_early_and_shrinks_lazily(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """LLM-Mesh §6.2 on the pool: with requests waiting the engine holds their expected KV
    plus the watermark at once; once they finish, what they used goes back to the pool."""
    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client, refill=1, prefix_caching=False)
        engine.avg_out = 16.0  # the average output so far (tokens)
        w = engine.watermark
        for p in prompts(4):
            engine.add_request(p, GREEDY)
        engine.scale_kv()
        tokens = sum(len(p) + 16 for p in prompts(4))
        expected = w.recommend(-(-max(tokens, w.min_tokens) // BLOCK))
        assert len(engine.blocks.free) == expected  # fetched before any step needs them
        held_before = client.stats()["kv_bytes"]
        engine.scale_kv()
        assert client.stats()["kv_bytes"] == held_before  # within the watermark: no ping-pong
        while engine.has_unfinished():
            engine.step()
        engine.scale_kv()  # idle now: L_min plus the watermark stays, the rest goes back
        assert len(engine.blocks.free) == w.recommend(-(-w.min_tokens // BLOCK))
        block_bytes = kv_block_bytes(LlamaConfig.from_hf(tiny.config), BLOCK, torch.float32)
        assert client.stats()["kv_bytes"] == len(engine.blocks.free) * block_bytes
        engine.close()


def test_steps_measured_against_the_time_table_give_the_slowdown(
    tiny: RegisteredModel, pool: PoolProcess
) -> None:
    """A table that promises 1 us per iteration: every measured step is slower, the slowdown
    the state page reports rises to its bound (the agent then validates at that speed)."""
    import asyncio
    import time

    from runtime.mesh.state_page import MAX_SLOWDOWN
    from runtime.mesh.time_table import TimeTable

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        us = 1e-6
        engine.table = TimeTable((1, 1024), (us, us), (1, 64), (1, 4096), ((us, us), (us, us)))

        async def run() -> None:
            driver = asyncio.create_task(engine.run_forever())
            for p in prompts(3):
                await anext(engine.stream(p, GREEDY))
            driver.cancel()

        t0 = time.perf_counter()
        asyncio.run(run())
        assert time.perf_counter() - t0 > 0
        assert engine.slowdown > 5 and engine.slowdown <= MAX_SLOWDOWN


def test_the_choices_of_an_n_request_are_validated_together(tiny: RegisteredModel, pool: PoolProcess) -> None:
    """Each choice of an n > 1 request is admitted with its siblings already admitted on the
    page: n prefills of 0.11 s each (with the margin) fit a 0.5 s TTFT SLO only up to n = 4."""
    slo = Slo(ttft_s=0.5)
    table = TimeTable((1, 1024), (0.1, 0.1), (1, 64), (1, 4096), ((0.001, 0.001), (0.001, 0.001)))

    async def admit(engine: Engine, n: int) -> float:
        grants = DeviceGrants("cpu")
        agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        buf = memoryview(bytearray(PAGE_BYTES))
        grants.attach("a", agent_end, InstanceView(StatePage(buf), table, slo, 4096))
        engine.schedule_with(Gate(worker_end, StatePage(buf)), slo)
        try:
            return await engine.admit(8, n)
        finally:
            assert engine.gate is not None
            engine.gate.close()
            grants.close()
            agent_end.close()

    with PoolClient(pool.socket_path) as client:
        engine = make_engine(tiny, client)
        asyncio.run(admit(engine, 4))
        with pytest.raises(SloUnattainable):
            asyncio.run(admit(engine, 5))
        assert engine.seqs == {}
        engine.close()
