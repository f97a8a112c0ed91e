"""A function instance: one worker process serving one registered model over HTTP.

It attaches to its device's pool, binds the model to the pool's tensor views (no copies),
builds the engine from the materialized profile (no profiling) and serves
OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (plain JSON or SSE
chunks with ``usage``) plus ``/healthz``. The gateway proxies invocations here. On
SIGTERM the server stops, the engine returns its KV blocks and the pool session closes, so
the weights stay resident, inactive, for the next instance.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.chat import ChatTemplateError, render_chat
from runtime.engine.engine import Engine, EngineConfig, StepOutput
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import KVCacheExhausted
from runtime.registry import RegisteredModel, load


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str


class RequestError(Exception):
    """A client mistake: answered with HTTP 400 and an OpenAI-style error body."""


@dataclass
class Worker:
    """The engine of one function plus what the HTTP layer needs around it."""

    name: str
    model: RegisteredModel
    engine: Engine
    tokenizer_config: dict[str, Any]
    max_tokens_default: int

    def encode(self, request: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(request, ChatRequest):
            messages = [m.model_dump() for m in request.messages]
            try:
                text = render_chat(
                    self.tokenizer_config.get("chat_template"), messages, self.tokenizer_config
                )
            except ChatTemplateError as exc:
                raise RequestError(str(exc)) from None
        else:
            text = request.prompt
        ids: list[int] = self.engine.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise RequestError("the prompt is empty")
        return ids

    def params(self, request: _Sampling, prompt_len: int) -> SamplingParams:
        stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
        max_tokens = request.max_tokens or min(self.max_tokens_default, self.engine.max_context - prompt_len)
        if max_tokens < 1 or prompt_len + max_tokens > self.engine.max_context:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; with max_tokens={max_tokens} it exceeds the model's "
                f"context of {self.engine.max_context} tokens"
            )
        try:
            return SamplingParams(
                max_tokens=max(1, max_tokens),
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                stop=stop,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
            )
        except ValueError as exc:
            raise RequestError(str(exc)) from None


def build_app(worker: Worker) -> FastAPI:
    """The FastAPI app of a worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        driver = asyncio.create_task(worker.engine.run_forever())  # steps the engine between requests
        try:
            yield
        finally:
            driver.cancel()
            worker.engine.close()

    app = FastAPI(title=f"ember worker: {worker.name}", lifespan=lifespan)

    def error(status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "function": worker.name, "model": worker.model.model_id}

    async def handle(raw: Request, chat: bool) -> Any:
        try:
            body = await raw.json()
        except json.JSONDecodeError as exc:
            return error(400, "invalid_request_error", f"body is not valid JSON: {exc}")
        try:
            request = ChatRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
            ids = worker.encode(request)
            params = worker.params(request, len(ids))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return error(400, "invalid_request_error", f"{where}: {first['msg']}")
        except RequestError as exc:
            return error(400, "invalid_request_error", str(exc))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        stream = worker.engine.stream(ids, params)
        if request.stream:
            return StreamingResponse(
                _sse(stream, rid, worker.name, chat, len(ids)), media_type="text/event-stream"
            )
        text, n, reason = "", 0, None
        try:
            async for out in stream:
                text += out.text_delta
                n += 1
                reason = out.finish_reason
        except KVCacheExhausted as exc:
            return error(503, "kv_cache_exhausted", str(exc))
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason.value if reason else None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": worker.name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n},
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Any:
        return await handle(raw, chat=True)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        return await handle(raw, chat=False)

    return app


async def _sse(
    stream: AsyncIterator[StepOutput], rid: str, model: str, chat: bool, prompt_tokens: int
) -> AsyncIterator[bytes]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = 0

    def chunk(delta: str | None, reason: str | None, usage: dict[str, int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = {"content": delta} if delta is not None else {"role": "assistant"}
        else:
            choice["text"] = delta or ""
        body: dict[str, Any] = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n".encode()

    if chat:
        yield chunk(None, None)
    try:
        async for out in stream:
            n += 1
            reason = out.finish_reason.value if out.finish_reason else None
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": prompt_tokens + n,
            }
            if out.text_delta or reason:
                yield chunk(out.text_delta, reason, usage if reason else None)
    except KVCacheExhausted as exc:  # one error event, as OpenAI streams do
        yield f"data: {json.dumps({'error': {'type': exc.code, 'message': str(exc)}})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def start_worker(name: str, model_dir: Path, pool_socket: str, max_tokens: int = 2048) -> tuple[Worker, Any]:
    """Attach to the pool, bind the model, build the engine; returns the worker and its client."""
    import torch
    from tokenizers import Tokenizer

    from gpu_pool.client import PoolClient
    from runtime.engine.kv_storage import PoolBlockSource, arena_kv_view
    from runtime.generate import eos_ids
    from runtime.models.llama import LlamaConfig, LlamaModel

    model = load(model_dir)
    profile = model.profile("cpu")
    client = PoolClient(pool_socket)
    config = LlamaConfig.from_hf(model.config)
    dtype = getattr(torch, profile["kv_dtype"])
    llama = LlamaModel(config, client.acquire(model.manifest()))
    kv = arena_kv_view(client.arena(), config, profile["block_size"], dtype, profile["kv_block_bytes"])
    tok = Tokenizer.from_file(str(model.directory / "tokenizer.json"))
    engine = Engine(
        llama,
        tok,
        kv,
        PoolBlockSource(client, profile["kv_block_bytes"]),
        eos_ids(model, tok),
        EngineConfig(profile["block_size"]),
    )
    tok_cfg = json.loads((model.directory / "tokenizer_config.json").read_text())
    return Worker(name, model, engine, tok_cfg, max_tokens), client


def serve(name: str, model_dir: Path, pool_socket: str, host: str = "127.0.0.1", port: int = 0) -> None:
    """Run a worker until SIGTERM; prints one JSON readiness line with its URL."""
    import socket

    import uvicorn

    worker, client = start_worker(name, model_dir, pool_socket)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(worker), log_level="warning", lifespan="on"))

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        print(json.dumps({"event": "ready", "url": url, "function": name}), flush=True)
        await task

    try:
        asyncio.run(main())
    finally:
        client.close()
