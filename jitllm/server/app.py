"""The HTTP side (Starlette): routes that check a request, queue its jobs on the engine and turn the engine's
events into OpenAI's responses (whole, or streamed as server-sent events ending in `data: [DONE]`), and the
guard in front of them (API key, placement off loopback, body size, request counts). A client's mistake is
an OpenAI-style JSON error, never a traceback."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jitllm.core.errors import JitllmError
from jitllm.server.choices import Choice, StopStrings
from jitllm.server.engine import Engine, Failed, Finished, Job
from jitllm.server.errors import ApiError
from jitllm.server.metrics import Metrics
from jitllm.server.responses import Responses, sse, usage
from jitllm.server.schemas import GenerationRequest, parse_chat, parse_completion

MAX_BODY = 4 << 20


@dataclass(frozen=True)
class AppSettings:
    model_id: str
    api_key: str | None = None
    loopback: bool = True
    """Bound to a loopback address: without an API key, the placement endpoint is open only then."""
    max_body: int = MAX_BODY


class Server:
    """The routes over one engine."""

    def __init__(self, engine: Engine, settings: AppSettings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.created = int(time.time())

    # -- generation ---------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = parse_chat(await read_json(request, self.settings.max_body))
        model = self._model(req)
        try:
            ids = model.tokenizer.encode_chat(req.prompts[0])
        except JitllmError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await self._generate(request, req, [ids], chat=True)

    async def completions(self, request: Request) -> Response:
        req = parse_completion(await read_json(request, self.settings.max_body))
        model = self._model(req)
        vocab = model.layout.config.vocab
        prompts = [model.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        if any(t >= vocab for ids in prompts for t in ids):
            raise ApiError(400, f"'prompt' holds token ids past the vocabulary of {vocab}", param="prompt")
        return await self._generate(request, req, prompts, chat=False)

    def _model(self, req: GenerationRequest):
        if req.model is not None and req.model != self.settings.model_id:
            raise ApiError(404, f"The model '{req.model}' does not exist (this server has '{self.settings.model_id}')",
                           param="model", code="model_not_found")
        if not self.engine.ready:
            raise ApiError(503, f"model {self.engine.stage}")
        return self.engine.model

    async def _generate(self, request: Request, req: GenerationRequest, prompts: list[list[int]], chat: bool) -> Response:
        ctx = self.engine.model.executor.ctx
        for ids in prompts:
            if not ids:
                raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
            if len(ids) >= ctx:
                raise ApiError(400, f"the prompt is {len(ids)} tokens, which leaves no room in the context of {ctx}",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
        if len(prompts) * req.n > self.engine.settings.parallel + self.engine.settings.queue:
            raise ApiError(400, f"{len(prompts) * req.n} choices are more than this server takes at once", param="n")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        jobs, choices = [], []
        tokenizer = self.engine.model.tokenizer
        for ids in prompts:
            for j in range(req.n):
                index = len(jobs)
                seed = req.sampling.seed
                sampling = req.sampling if seed is None else replace(req.sampling, seed=seed + j)
                jobs.append(Job(ids, min(req.max_tokens or ctx, ctx - len(ids)), sampling, req.top_logprobs,
                                req.ignore_eos, _deliverer(loop, events, index)))
                choices.append(Choice(index, tokenizer.stream(), StopStrings(req.stop)))
        self.engine.submit(jobs)
        kind = "chatcmpl" if chat else "cmpl"
        out = Responses(f"{kind}-{uuid.uuid4().hex}", self.settings.model_id, int(time.time()), chat, tokenizer)
        run = _Run(jobs, choices, events, [len(ids) for ids in prompts], req.n)
        if req.stream:
            return StreamingResponse(self._stream(run, out, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(run.collect())
        left = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not collect.done():
                collect.cancel()
                run.cancel()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # (the client is gone)
        return JSONResponse(out.whole(choices, collect.result()))

    async def _stream(self, run: _Run, out: Responses, include_usage: bool):
        try:
            if out.chat:
                for choice in run.choices:
                    yield sse(out.chunk(choice.index, None, [], first=True))
            async for choice, text, tokens in run.pieces():
                if text or tokens:
                    yield sse(out.chunk(choice.index, text, tokens))
                if choice.finished is not None:
                    yield sse(out.chunk(choice.index, None, [], choice.finish_reason))
            if include_usage:
                yield sse(out.usage_chunk(run.usage()))
            yield sse("[DONE]")
        except ApiError as e:  # (after the 200 went out: the error as an event, as OpenAI's streams do)
            yield sse(e.body())
        finally:
            run.cancel()

    # -- the rest -----------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.settings.model_id:
            raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        card = {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "jitllm"}
        if self.engine.ready:
            card["context_length"] = self.engine.model.executor.ctx
        return card

    async def health(self, request: Request) -> Response:
        if self.engine.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "stage": self.engine.stage, "compiled": self.engine.compiled},
                            status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

    async def sessions(self, request: Request) -> Response:
        listed = await asyncio.wrap_future(self.engine.call(lambda model: self.engine.cache.describe()))
        return JSONResponse({"object": "list", "data": listed})

    async def placement(self, request: Request) -> Response:
        from jitllm.server import placement

        if request.method == "GET":
            return JSONResponse(await asyncio.wrap_future(self.engine.call(placement.describe)))
        body = await read_json(request, self.settings.max_body)
        spec = body.get("moves") if isinstance(body, dict) else None
        if not isinstance(spec, str) or not spec.strip():
            raise ApiError(400, "'moves' must be a string of SEL=TARGET entries, e.g. \"0-3=host,head=cuda:0\"",
                           param="moves")
        try:
            moving = self.engine.call_in_pieces(lambda model: placement.move(model, spec, self.metrics,
                                                                              self.engine.batching))
            moved = await asyncio.wrap_future(moving)
        except JitllmError as e:
            raise ApiError(400, str(e), param="moves") from None
        return JSONResponse(moved)


class _Run:
    """The jobs of one request as their events arrive: choices' text, stop strings, usage."""

    def __init__(self, jobs: list[Job], choices: list[Choice], events: asyncio.Queue, prompt_sizes: list[int],
                 n: int) -> None:
        self.jobs, self.choices, self.events, self.prompt_sizes, self.n = jobs, choices, events, prompt_sizes, n

    async def pieces(self):
        """(choice, text it adds, the tokens with logprobs) per event, until every choice ends."""
        open_choices = len(self.choices)
        while open_choices:
            index, event = await self.events.get()
            choice = self.choices[index]
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message)
            if isinstance(event, Finished):
                open_choices -= 1
                yield choice, choice.end(event), []
            elif choice.finish_reason is None:  # (tokens the engine made after a stop string are dropped)
                text = choice.add(event)
                if choice.finish_reason is not None:
                    self.jobs[index].cancelled = True
                yield choice, text, [event] if event.logprob is not None else []

    async def collect(self) -> dict:
        async for _ in self.pieces():
            pass
        return self.usage()

    def usage(self) -> dict:
        cached = sum(max(c.finished.cached_tokens for c in self.choices[p * self.n:(p + 1) * self.n])
                     for p in range(len(self.prompt_sizes)))
        return usage(sum(self.prompt_sizes), sum(c.tokens for c in self.choices), cached)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled = True


def _deliverer(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """A job's `deliver`: its events into the request's queue, from the engine thread."""

    def deliver(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # (the event loop has closed: the server is gone)
            pass

    return deliver


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes, 400 when it does not parse."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
    try:
        value = json.loads(body)
        json.dumps(value, ensure_ascii=False).encode()  # (an escaped lone surrogate, "\\ud800", is no text)
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds a string that is not Unicode text (a lone surrogate such "
                            "as \\ud800)") from None
    except ValueError as e:  # (UnicodeDecodeError is one)
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    return value


class Guard:
    """ASGI middleware before every route: the API key (when set), the placement endpoint closed off loopback
    without a key, a declared body size past the limit, and each answer's status counted by route."""

    def __init__(self, app, settings: AppSettings, metrics: Metrics, routes: set[str]) -> None:
        self.app, self.settings, self.metrics, self.routes = app, settings, metrics, routes
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    def refusal(self, scope) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.expected is not None:
            given = headers.get(b"authorization")
            if given is None:
                return ApiError(401, "this server needs an API key: Authorization: Bearer KEY", code="invalid_api_key")
            if not hmac.compare_digest(given, self.expected):
                return ApiError(401, "the API key is not this server's", code="invalid_api_key")
        elif scope["path"] == "/v1/placement" and not self.settings.loopback:
            return ApiError(403, "the placement endpoint is closed on a non-loopback address without -api-key")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.settings.max_body:
            return ApiError(413, f"the request body is over {self.settings.max_body} bytes")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refused = self.refusal(scope)
            if refused is not None:
                await _error_response(refused)(scope, receive, counted)
            else:
                await self.app(scope, receive, counted)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return _error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return _error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))))


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug of ours: a JSON 500 (uvicorn logs the traceback on stderr)."""
    return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                   "param": None, "code": None}}, status_code=500)


def build_app(engine: Engine, settings: AppSettings, metrics: Metrics) -> Guard:
    server = Server(engine, settings, metrics)
    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model, methods=["GET"]),
        Route("/v1/sessions", server.sessions, methods=["GET"]),
        Route("/v1/placement", server.placement, methods=["GET", "POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                                      Exception: _server_error})
    return Guard(app, settings, metrics, {r.path for r in routes})
