"""A function instance's model binding: tensors from the pool, engine, tokenizer, request encoding.

A :class:`ModelTemplate` is everything about a registered model that does not depend on the
pool (tokenizer, chat template, config, materialized profile). Pre-warmed workers build
templates ahead of time (TIDAL's templates), because ``Tokenizer.from_file`` alone costs
about 186 ms on SmolLM2 (DESIGN.md, cold-start budget). :func:`bind` then turns a template
into a serving :class:`ModelBinding` from resident tensors: pool acquire, model views, KV
view, engine, with the time of each step recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from gpu_pool.acquire_report import AcquireReport
from runtime.chat import ChatTemplate, ChatTemplateError
from runtime.engine.engine import Engine, EngineConfig, HangUp, StepOutput
from runtime.engine.sampling import SamplingParams
from runtime.openai_api import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    check_prompt_chars,
    choice_params,
    sampling_params,
)
from runtime.openai_response import Completion, Reporter, collect
from runtime.openai_tools import StructuredPlan, chat_messages, request_plan
from runtime.registry import RegisteredModel, load
from runtime.token_text import TokenText

log = logging.getLogger("ember.worker")

MAX_WARM_ROWS = 16  # warm_up runs prefills of 1..16 rows (a prompt's tokens past its cached prefix)

if TYPE_CHECKING:  # torch-importing modules: loaded by the first constrained request only
    from runtime.adapters import RegisteredAdapter
    from runtime.structured.cache import GrammarCache
    from runtime.structured.constraint import Constraint


@dataclass(frozen=True)
class ModelTemplate:
    """What an instance of a registered model needs before it touches the pool."""

    model: RegisteredModel
    tokenizer: Any  # tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]
    eos_ids: frozenset[int]
    profile: dict[str, Any]
    chat: ChatTemplate
    # The pool manifest (gpu_pool.manifest.Manifest), read and encoded once: every acquire sends it.
    manifest: Any


@dataclass(frozen=True)
class AdapterTemplate:
    """A LoRA adapter of the function (``spec.model.adapters``): its name in requests and its
    registered entry, the manifest read and encoded once (every instance acquires it)."""

    name: str
    adapter: RegisteredAdapter
    manifest: Any  # gpu_pool.manifest.Manifest, every tensor dynamic (session-private in the pool)


def load_adapters(adapters: tuple[tuple[str, str], ...]) -> tuple[AdapterTemplate, ...]:
    """The templates of ``(name, registered adapter directory)`` pairs."""
    if not adapters:  # most functions: the import (~2 ms) would sit on every cold start
        return ()
    from runtime.adapters import load_adapter

    out = []
    for name, directory in adapters:
        adapter = load_adapter(Path(directory))
        manifest = adapter.manifest()
        manifest.encoded()
        out.append(AdapterTemplate(name, adapter, manifest))
    return tuple(out)


def load_template(model_dir: Path) -> ModelTemplate:
    """Read a registered model's tokenizer, chat template, EOS ids and CPU profile."""
    from tokenizers import Tokenizer

    from runtime.generate import eos_ids

    model = load(model_dir)
    tok = Tokenizer.from_file(str(model.directory / "tokenizer.json"))
    cfg_path = model.directory / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    chat = ChatTemplate(tok_cfg.get("chat_template"), tok_cfg)
    manifest = model.manifest()
    manifest.encoded()  # cached on the manifest: the first acquire does not pay for it
    return ModelTemplate(
        model, tok, tok_cfg, frozenset(eos_ids(model, tok)), model.profile("cpu"), chat, manifest
    )


def warm_up(
    template: ModelTemplate,
    prompt_lengths: tuple[int, ...] = (8, 24, 48),
    decode_steps: int = 4,
    prefill_rows: tuple[int, ...] = tuple(range(1, MAX_WARM_ROWS + 1)),
) -> float:
    """Run the engine once on zero weights of the template's shapes; returns the seconds spent.

    A fresh process pays several hundred milliseconds on its first forward passes (oneDNN
    primitive creation per matmul shape, thread-pool start, allocator growth). A pre-warmed
    worker pays them here, with private zero weights of the model's exact shapes, so an
    instance's first request runs as fast as a warm one. Every decoder layer has the same
    shapes, so one layer (plus the embeddings and head) warms them all: a worker preloading
    many models, or a 1.5 B one, pays a fraction of a second each instead of seconds and
    gigabytes of zeros. Weights and KV are freed afterwards. A chat message is rendered and
    tokenized too (:func:`_warm_text`).

    A matmul's shape includes its rows, and a prefill has as many as the prompt's tokens that
    no cached prefix covers: a few, in the first request of an instance whose function's
    prefix the pool kept. A row count the process never ran cost ~4 ms more per linear shape,
    10 ms of such a request's 30 ms TTFT on a 2-core host (the warm instance it is compared
    with had run it). So each of ``prefill_rows`` runs once too, one token each; longer
    prefills take longer, and the same cost weighs less there.
    """
    import dataclasses

    import torch

    from runtime.engine.build import PrivateKV, build_engine
    from runtime.models.llama import LlamaConfig, LlamaModel

    t0 = time.perf_counter()
    manifest = template.model.manifest()
    dtype = getattr(torch, template.profile["kv_dtype"])
    weights = {
        e.name: torch.zeros(tuple(e.shape), dtype=getattr(torch, e.dtype))
        for e in manifest.tensors
        if not e.name.startswith("model.layers.") or e.name.startswith("model.layers.0.")
    }
    config = dataclasses.replace(LlamaConfig.from_hf(template.model.config), num_layers=1)
    block_size = template.profile["block_size"]
    num_blocks = -(-(max(prompt_lengths) + decode_steps) // block_size) * len(prompt_lengths)
    engine = build_engine(
        LlamaModel(config, weights),
        template.tokenizer,
        template.eos_ids,
        PrivateKV(num_blocks),
        dtype,
        EngineConfig(block_size),
    )
    params = SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True)
    for n in prompt_lengths:  # one at a time, then all together (batched decode)
        engine.generate([[1] * n], params)
    engine.generate([[1] * n for n in prompt_lengths], params)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(prefill_rows):  # distinct first tokens: no cached prefix shortens one
        engine.generate([[2 + i] * n], one)
    engine.close()
    _warm_text(template)
    return time.perf_counter() - t0


def _warm_text(template: ModelTemplate) -> None:
    """Render and tokenize one chat message: the first of each in a process costs ~0.5 ms
    more than the next (the tokenizer's and the template's lazy set-up), on a cold start's path.
    Best effort: a template that cannot render this message (ChatTemplateError: each request
    finds out for itself) or a failure of any kind never stops a worker from starting."""
    try:
        try:
            text = template.chat.render([{"role": "user", "content": "Hello!"}])
        except ChatTemplateError:  # no usable template for this message: the plain text, then
            text = "Hello!"
        template.tokenizer.encode(text, add_special_tokens=False)
    except Exception:
        log.warning("warming the tokenizer of %s failed", template.model.directory, exc_info=True)


# Requests of at most this many characters in at most INLINE_MESSAGES messages without tool
# calls are rendered and tokenized on the event loop: 0.2-0.8 ms (SmolLM2's tokenizer on this
# host: 0.15-0.74 us per character, English to digits), less than a thread hop can cost while
# the engine's threads hold the cores (the thread waits for a CPU, up to a scheduler slice:
# ~3 ms). Longer texts are tokenized with the GIL released (encode_text).
INLINE_ENCODE_CHARS = 1024
INLINE_MESSAGES = 8


def _small(request: ChatRequest | CompletionRequest, chars: int) -> bool:
    """Whether ``request`` (``chars``: its :attr:`chars`, counted once by the caller) is
    rendered and tokenized on the event loop (INLINE_ENCODE_CHARS)."""
    if chars > INLINE_ENCODE_CHARS:
        return False
    return not isinstance(request, ChatRequest) or (
        len(request.messages) <= INLINE_MESSAGES and request.num_tool_calls == 0
    )


class Prepared(NamedTuple):
    """A request ready for the engine (:meth:`ModelBinding.prepare_all`)."""

    ids: list[int]  # the prompt's token ids
    params: SamplingParams  # of the first choice (runtime.openai_api.choice_params: the others)
    plan: StructuredPlan | None  # response_format / tools; None: free text
    constraints: list[Constraint] | None  # one per choice; None: unconstrained
    adapter: str | None = None  # the LoRA adapter's key (the request's model: FUNCTION:ADAPTER)

    @property
    def calls_tools(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.plan is not None and self.plan.calls_tools


@dataclass
class ModelBinding:
    """The engine of one instance plus request encoding in the model's own format."""

    template: ModelTemplate
    engine: Engine
    max_tokens_default: int
    acquire_report: AcquireReport  # what the pool's acquire of the weights cost
    timings_ms: dict[str, float] = field(default_factory=dict)
    _tokens: TokenText | None = field(default=None, repr=False)  # built on first logprobs request
    grammars: GrammarCache | None = None  # built by the first constrained request
    kv_quota_blocks: int | None = None  # KV blocks the instance's pool ticket allows (None: no quota)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> key (its id)

    def adapter(self, model: str | None) -> str | None:
        """The adapter key a request's ``model`` selects: ``FUNCTION:ADAPTER`` (vLLM's
        convention of one served name per adapter), or None (the plain function name: the
        base model alone). :class:`RequestError` for an adapter the function does not have."""
        if model is None or ":" not in model:
            return None
        name = model.partition(":")[2]  # the gateway routes on what comes before the first ":"
        key = self.adapters.get(name)
        if key is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise RequestError(
                f"model: this function has no adapter {name[:64]!r} (adapters: {known})",
                "model",
                "model_not_found",
            )
        return key

    def encode(
        self, request: ChatRequest | CompletionRequest, plan: StructuredPlan | None = None
    ) -> list[int]:
        """Token ids of a chat (rendered with the model's template, with the tools that
        ``plan`` offers) or completion prompt."""
        if isinstance(request, ChatRequest):
            messages, tools = chat_messages(request.template_messages(), plan, self.template.chat.reads_tools)
            return self.encode_chat(messages, tools)
        return self.encode_text(request.prompt)

    async def constraints(self, plan: StructuredPlan | None, n: int = 1) -> list[Constraint] | None:
        """The decoding constraint of ``plan`` for each of ``n`` choices (None: unconstrained;
        one matcher per choice, the compiled grammar shared); compiling runs in a thread."""
        if plan is None or plan.spec is None:
            return None
        if self.grammars is None:
            from runtime.structured.cache import GrammarCache

            self.grammars = GrammarCache(self.template.tokenizer, self.template.eos_ids)
        grammars, spec = self.grammars, plan.spec
        return await asyncio.to_thread(lambda: [grammars.constraint(spec) for _ in range(n)])

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        try:
            text = self.template.chat.render(messages, tools)
        except ChatTemplateError as exc:
            raise RequestError(str(exc), "messages", exc.code) from None
        return self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        tokenizer = self.template.tokenizer
        if len(text) <= INLINE_ENCODE_CHARS:
            ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
        else:  # encode holds the GIL throughout (the event loop would stop), encode_batch not
            ids = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if not ids:
            raise RequestError("the prompt is empty", None, "invalid_value")
        return ids

    def params(self, request: ChatRequest | CompletionRequest, prompt_len: int) -> SamplingParams:
        vocab = self.engine.runner.model.config.vocab_size
        return sampling_params(request, prompt_len, self.engine.max_context, self.max_tokens_default, vocab)

    async def prepare(
        self, request: ChatRequest | CompletionRequest, plan: StructuredPlan | None = None
    ) -> tuple[list[int], SamplingParams]:
        """Token ids and sampling parameters (of the first choice) of ``request`` (rendered with
        the tools ``plan`` offers), or :class:`RequestError`.

        A prompt far beyond the context is rejected before tokenizing (by its length in
        characters); one that is not small (:func:`_small`) is rendered and tokenized in a
        thread, the text with the GIL released: the event loop keeps serving.
        """
        param = "messages" if isinstance(request, ChatRequest) else "prompt"
        chars = request.chars
        check_prompt_chars(chars, self.engine.max_context, param)
        if plan is None and _small(request, chars):
            ids = self.encode(request, plan)
        else:
            ids = await asyncio.to_thread(self.encode, request, plan)
        return ids, self.params(request, len(ids))

    async def prepare_all(self, request: ChatRequest | CompletionRequest) -> Prepared:
        """:meth:`prepare` with what ``response_format`` / ``tools`` ask (runtime.openai_tools):
        the plan and one decoding constraint per choice. :class:`RequestError` for a client
        mistake, a schema the grammar engine cannot enforce included (naming its field)."""
        from runtime.structured import StructuredError

        try:
            # Compiling schemas into grammars takes up to a second: off the engine's event loop.
            has_schemas = getattr(request, "tools", None) or getattr(request, "response_format", None)
            plan = await asyncio.to_thread(request_plan, request) if has_schemas else request_plan(request)
            if plan is not None and plan.calls_tools and request.stream:
                # Streamed tool calls are read from one choice's text, without log-probabilities.
                if request.n > 1:
                    raise RequestError("n: streamed tool calls take one choice", "n", "unsupported_value")
                if request.logprobs_k() is not None:
                    raise RequestError(
                        "logprobs: streamed tool calls carry no log-probabilities",
                        "logprobs",
                        "unsupported_value",
                    )
            adapter = self.adapter(request.model)
            ids, params = await self.prepare(request, plan)
            self.check_kv_room(len(ids), params.max_tokens, request.n)
            constraints = await self.constraints(plan, request.n)
        except StructuredError as exc:
            raise RequestError(str(exc), getattr(exc, "param", None), "invalid_value") from None
        return Prepared(ids, params, plan, constraints, adapter)

    def check_kv_room(self, prompt_len: int, max_tokens: int, n: int) -> None:
        """:class:`RequestError` when ``n`` choices of ``prompt_len + max_tokens`` tokens need
        more KV blocks than the instance's quota holds (``kv_quota_blocks``): they could never
        run together, and the engine would preempt and recompute them for as long as they ran
        while the instance's other requests waited behind them. The count is a lower bound
        (the prompt's full blocks shared by every choice, as the prefix cache can), so no
        request that could fit is refused."""
        if self.kv_quota_blocks is None:
            return
        block_size = self.engine.config.block_size
        shared = prompt_len // block_size
        need = shared + n * (-(-(prompt_len + max_tokens) // block_size) - shared)
        if need > self.kv_quota_blocks:
            raise RequestError(
                f"n: {n} choice(s) of {prompt_len} prompt + {max_tokens} output tokens need {need} KV "
                f"blocks; this instance holds at most {self.kv_quota_blocks} (ask for fewer choices or "
                "a smaller max_tokens)",
                "n" if n > 1 else "max_tokens",
                "invalid_value",
            )

    def streams(
        self,
        ids: list[int],
        params: SamplingParams,
        n: int = 1,
        constraints: list[Constraint] | None = None,
        arrival: float | None = None,
        adapter: str | None = None,
        hang_up: HangUp | None = None,
    ) -> list[AsyncIterator[StepOutput]]:
        """One engine stream per choice (:func:`~runtime.openai_api.choice_params`), each under
        its own constraint when given and with LoRA ``adapter`` (a key of :attr:`adapters`' values);
        each adds its sequence when first iterated. ``arrival``: when the request came (its SLO
        counts from then; see ``Engine.admit``); ``hang_up``: stops them all when called."""
        return [
            self.engine.stream(
                ids,
                choice_params(params, i),
                constraints[i] if constraints else None,
                arrival,
                adapter,
                hang_up,
            )
            for i in range(n)
        ]

    def reporter(self, params: SamplingParams) -> Reporter | None:
        """What turns log-probabilities into OpenAI's entries, when ``params`` asks for them."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return None
        if self._tokens is None:
            self._tokens = TokenText(self.template.tokenizer)
        return Reporter(self._tokens, self.template.eos_ids, params.ignore_eos)

    async def complete(
        self,
        ids: list[int],
        params: SamplingParams,
        n: int = 1,
        constraints: list[Constraint] | None = None,
        adapter: str | None = None,
    ) -> Completion:
        """Run one request (``n`` choices) to completion."""
        return await collect(
            self.streams(ids, params, n, constraints, adapter=adapter), ids, self.reporter(params)
        )

    def attach_adapters(self, client: Any, adapters: tuple[AdapterTemplate, ...]) -> None:
        """Acquire ``adapters`` in ``client``'s session (dynamic: private to it, loaded on every
        start, dropped with the session) and bind them to the engine's model beside the shared
        static base. :class:`runtime.models.lora.LoraError` when one does not fit the base."""
        if not adapters:
            return
        t0 = time.perf_counter()
        model = self.engine.runner.model
        for a in adapters:
            views = client.views(a.manifest, client.acquire_placements(a.manifest))
            model.adapters[a.adapter.adapter_id] = a.adapter.bind(views, model)
            self.adapters[a.name] = a.adapter.adapter_id
        self.timings_ms["adapters_ms"] = (time.perf_counter() - t0) * 1e3


def _block_prefill_s(profile: dict[str, Any]) -> float:
    """Seconds a prefill of one KV block takes, from the materialized warm-up timings."""
    warmup = profile.get("warmup") or {}
    tokens, ms = warmup.get("prefill_tokens"), warmup.get("prefill_ms")
    if not tokens or not ms:
        return 0.0
    return float(ms) / 1e3 / float(tokens) * int(profile["block_size"])


def bind(
    template: ModelTemplate,
    client: Any,
    max_tokens: int,
    kv_quota_bytes: int | None = None,
    adapters: tuple[AdapterTemplate, ...] = (),
    progressive: bool = True,
    on_load_failed: Callable[[], None] | None = None,
) -> ModelBinding:
    """Build a serving engine from the pool: acquire (resident tensors are not copied), views, KV.

    ``client`` is a connected :class:`gpu_pool.client.PoolClient`; it stays open for as long
    as the binding serves (closing it releases the weights, which stay resident).
    ``kv_quota_bytes``: what the instance's pool ticket allows (see :meth:`ModelBinding.check_kv_room`).
    ``adapters``: the function's LoRA adapters (:meth:`ModelBinding.attach_adapters`).
    ``progressive`` (TIDAL §5.2): when bytes must be loaded, the acquire returns before they are
    in and the model waits per layer, so the first prefill overlaps the load of later layers;
    False: load everything, then compute (the baseline of ``bench.overlap``). ``on_load_failed``:
    called once when a progressive load fails after the acquire returned (the first forward
    that needs the missing bytes finds out; the instance cannot serve).
    """
    t0 = time.perf_counter()
    readiness = None
    if progressive:
        from gpu_pool.readiness import MAX_READY_GROUPS
        from runtime.models.layer_gate import stage_groups

        names = [e.name for e in template.manifest.tensors]
        layers = int(template.model.config["num_hidden_layers"])
        groups = stage_groups(names, layers, MAX_READY_GROUPS)
        placements, readiness = client.acquire_progressive(template.manifest, groups)
    else:
        placements = client.acquire_placements(template.manifest)
    timings = {"acquire_ms": (time.perf_counter() - t0) * 1e3}
    binding = bind_at(
        template, client, placements, max_tokens, kv_quota_bytes, timings, readiness, on_load_failed
    )
    try:
        binding.attach_adapters(client, adapters)
    except BaseException:
        binding.engine.close()
        raise
    return binding


def bind_at(
    template: ModelTemplate,
    client: Any,
    placements: dict[str, int],
    max_tokens: int,
    kv_quota_bytes: int | None = None,
    timings: dict[str, float] | None = None,
    readiness: Any = None,
    on_load_failed: Callable[[], None] | None = None,
) -> ModelBinding:
    """:func:`bind` for weights ``client`` acquired at ``placements`` (arena offsets by tensor
    name): the views and the engine. ``timings`` gains ``build_ms``. ``readiness``: a
    :class:`gpu_pool.readiness.Readiness` of a progressive acquire still loading (the model
    waits per layer, :mod:`runtime.models.layer_gate`)."""
    import torch

    from runtime.engine.build import PoolKV, build_engine
    from runtime.engine.kv_storage import pool_block_bytes
    from runtime.models.llama import LlamaConfig, LlamaModel

    timings = {} if timings is None else timings
    t1 = time.perf_counter()
    profile = template.profile
    tensors = client.views(template.manifest, placements)
    config = LlamaConfig.from_hf(template.model.config)
    dtype = getattr(torch, profile["kv_dtype"])
    gate = None
    if readiness is not None:
        from runtime.models.embedding_rows import EmbeddingRows
        from runtime.models.layer_gate import LayerGate

        names = [e.name for e in template.manifest.tensors]
        rows = EmbeddingRows.of(template.manifest)
        tied = config.tie_word_embeddings
        gate = LayerGate(readiness, names, config.num_layers, on_load_failed, rows, tied)
    engine = build_engine(
        LlamaModel(config, tensors, gate=gate),
        template.tokenizer,
        template.eos_ids,
        PoolKV(client, profile["kv_block_bytes"], template.model.model_id, _block_prefill_s(profile)),
        dtype,
        EngineConfig(profile["block_size"]),
    )
    timings["build_ms"] = (time.perf_counter() - t1) * 1e3
    report: AcquireReport = client.last_acquire
    block_bytes = pool_block_bytes(int(profile["kv_block_bytes"]), client.alignment)  # as the pool counts
    quota_blocks = None if kv_quota_bytes is None else kv_quota_bytes // block_bytes
    return ModelBinding(template, engine, max_tokens, report, timings, kv_quota_blocks=quota_blocks)
