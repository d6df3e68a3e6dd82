"""The OpenAI-compatible HTTP gateway: HTTP in, ``GatewayBackend`` out.

``create_app(backend, site)`` builds the FastAPI app. A generation request
goes: API key -> body validation (400s) -> model lookup (404) -> tokenise
and fit into max_seq_len (400s) -> admission (429) -> ``backend.stream``
-> text (stop strings applied) -> JSON body or SSE events. Every request
that got past validation is answered: a backend refusal becomes its status,
anything unexpected a 500 (or, once an SSE stream has started, an error
event followed by ``data: [DONE]``). When the client goes away or a stop
string matches, the backend stream is closed, which aborts the request on
the serving side (see ``GatewayBackend.stream``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Optional

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from exaserve_hpc import metrics
from exaserve_hpc.config import SiteConfig
from exaserve_hpc.engine.tokenizer import ByteTokenizer, IncrementalDecoder, apply_chat_template
from exaserve_hpc.protocol import GenerateRequest, TokenChunk
from exaserve_hpc.router import openai_api as api
from exaserve_hpc.router.backend import BackendError, GatewayBackend, ModelInfo

log = logging.getLogger(__name__)

COMPLETIONS = "completions"
CHAT = "chat.completions"
_ENDPOINT_OF_PATH = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "/v1/models": "models",
                     "/v1/exaserve/status": "status"}
_OVERLOAD_RETRY_AFTER = 1.0  # seconds; a slot frees as soon as any in-flight request ends


class ApiError(Exception):
    """A request the gateway answers with an error status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: float = 0.0):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after


def error_response(error: ApiError, request_id: Optional[str] = None) -> JSONResponse:
    headers = {}
    if error.retry_after > 0 or error.status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(api.error_body(error.status, error.message, error.param, error.code), error.status, headers)


def _from_backend(error: BackendError) -> ApiError:
    return ApiError(error.status, error.message, code=error.code, retry_after=error.retry_after)


def _internal(request_id: str, exc: BaseException) -> ApiError:
    return ApiError(500, f"internal error while serving request {request_id} ({type(exc).__name__}: {exc}); "
                    "it has been logged; retry, and report the request id if it persists", code="internal_error")


# ------------------------------------------------------------ admission


class Admission:
    """Caps generation requests in flight: for the whole gateway, and per quota group."""

    def __init__(self, max_inflight: int, group_limits: dict[str, int]):
        self.max_inflight = max_inflight
        self.group_limits = group_limits
        self.inflight = 0
        self.by_group: dict[str, int] = {}

    def admit(self, group: Optional[str]) -> "Ticket":
        if self.inflight >= self.max_inflight:
            raise ApiError(429, f"the gateway is at its limit of {self.max_inflight} requests in flight "
                           "(gateway.max_queued_requests); retry after the Retry-After seconds",
                           code="overloaded", retry_after=_OVERLOAD_RETRY_AFTER)
        limit = self.group_limits.get(group) if group else None
        if limit is not None and self.by_group.get(group, 0) >= limit:
            raise ApiError(429, f"quota group {group!r} already has {limit} requests in flight, its "
                           "max_concurrent_requests; wait for one to finish", code="quota_exceeded",
                           retry_after=_OVERLOAD_RETRY_AFTER)
        self.inflight += 1
        if group:
            self.by_group[group] = self.by_group.get(group, 0) + 1
        metrics.INFLIGHT_REQUESTS.inc()
        return Ticket(self, group)


class Ticket:
    """One admitted request's slot; ``release`` is idempotent (several paths end a request)."""

    def __init__(self, admission: Admission, group: Optional[str]):
        self._admission, self._group, self._held = admission, group, True

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        self._admission.inflight -= 1
        if self._group:
            self._admission.by_group[self._group] -= 1
        metrics.INFLIGHT_REQUESTS.dec()


# ------------------------------------------------------------ text out of token chunks


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._longest = max(map(len, stops), default=0)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched); after a match the rest is dropped."""
        if not self.stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[:min(hits)], True
        keep = self._partial_stop_at_end(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_stop_at_end(self, buffer: str) -> int:
        for size in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0


class Generation:
    """One admitted request: backend token chunks -> text, until finished or a stop string matches.

    ``close()`` must be called whatever happens (it is idempotent): it closes
    the backend stream (aborting the request there if it was not finished),
    frees the admission slot and counts the tokens.
    """

    def __init__(self, backend: GatewayBackend, request: GenerateRequest, stops: list[str], ticket: Ticket,
                 arrived: float):
        self.request = request
        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self._chunks = backend.stream(request)
        self._first: Optional[TokenChunk] = None
        self._decoder = IncrementalDecoder()
        self._stops = StopMatcher(stops)
        self._ticket = ticket
        self._arrived = arrived
        self._closed = False

    async def start(self) -> None:
        """Wait for the first chunk, so that a refusal can still be answered with its HTTP status."""
        if self._first is None:
            self._first = await self._next_chunk()
            metrics.TIME_TO_FIRST_TOKEN.labels(self.request.model).observe(time.perf_counter() - self._arrived)

    async def texts(self) -> AsyncIterator[str]:
        """Pieces of completion text; when it ends, ``finish_reason`` is set."""
        await self.start()
        chunk = self._first
        while True:
            self.completion_tokens += len(chunk.token_ids)
            text = self._decoder.feed(chunk.token_ids)
            if chunk.finished:
                text += self._decoder.flush()
            text, stopped = self._stops.feed(text)
            if stopped:
                self.finish_reason = "stop"
            elif chunk.finished:
                text += self._stops.flush()
                self.finish_reason = chunk.finish_reason or "stop"
            if text:
                yield text
            if self.finish_reason:
                return
            chunk = await self._next_chunk()

    async def _next_chunk(self) -> TokenChunk:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"the backend stream of request {self.request.request_id} ended without "
                               "a finished chunk") from None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Shielded: on a client disconnect this runs inside a cancelled task, and the
            # backend still has to hear about the abort.
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
        finally:
            self._ticket.release()
            metrics.GENERATED_TOKENS.labels(self.request.model).inc(self.completion_tokens)


# ------------------------------------------------------------ response shapes


def _json_answer(endpoint: str, gen: Generation, text: str) -> dict:
    rid, created, model = gen.request.request_id, api.now(), gen.request.model
    usage = api.usage(gen.prompt_tokens, gen.completion_tokens)
    if endpoint == CHAT:
        return api.chat_body(api.new_chat_completion_id(rid), created, model, text, gen.finish_reason, usage)
    return api.completion_body(api.new_completion_id(rid), created, model, text, gen.finish_reason, usage)


class _CompletionEvents:
    """SSE chunks of /v1/completions."""

    object = "text_completion"

    def __init__(self, gen: Generation, include_usage: bool):
        self.id = api.new_completion_id(gen.request.request_id)
        self.created, self.model, self.include_usage = api.now(), gen.request.model, include_usage

    def opening(self) -> list[bytes]:
        return []

    def text(self, text: str, finish_reason: Optional[str] = None) -> bytes:
        return api.sse_event(api.completion_chunk(self.id, self.created, self.model, text, finish_reason,
                                                  self.include_usage))

    def finish(self, reason: str) -> bytes:
        return self.text("", reason)

    def usage(self, usage: dict) -> bytes:
        return api.sse_event(api.usage_chunk(self.object, self.id, self.created, self.model, usage))


class _ChatEvents(_CompletionEvents):
    """SSE chunks of /v1/chat/completions: the role comes first, then content deltas."""

    object = "chat.completion.chunk"

    def __init__(self, gen: Generation, include_usage: bool):
        super().__init__(gen, include_usage)
        self.id = api.new_chat_completion_id(gen.request.request_id)

    def _delta(self, delta: dict, finish_reason: Optional[str] = None) -> bytes:
        return api.sse_event(api.chat_chunk(self.id, self.created, self.model, delta, finish_reason,
                                            self.include_usage))

    def opening(self) -> list[bytes]:
        return [self._delta({"role": "assistant", "content": ""})]

    def text(self, text: str, finish_reason: Optional[str] = None) -> bytes:
        return self._delta({"content": text})

    def finish(self, reason: str) -> bytes:
        return self._delta({}, reason)


async def _sse_events(endpoint: str, gen: Generation, include_usage: bool) -> AsyncIterator[bytes]:
    events = (_ChatEvents if endpoint == CHAT else _CompletionEvents)(gen, include_usage)
    try:
        try:
            for event in events.opening():
                yield event
            async for text in gen.texts():
                yield events.text(text)
            yield events.finish(gen.finish_reason)
            if include_usage:
                yield events.usage(api.usage(gen.prompt_tokens, gen.completion_tokens))
        except BackendError as exc:
            yield api.sse_event(api.error_body(exc.status, exc.message, code=exc.code))
        except Exception as exc:  # headers are sent: the only way left to answer is an error event
            log.exception("request %s failed mid-stream", gen.request.request_id)
            error = _internal(gen.request.request_id, exc)
            yield api.sse_event(api.error_body(500, error.message, code=error.code))
        yield api.SSE_DONE
    finally:
        await gen.close()


async def _collect_unless_disconnected(request: Request, gen: Generation) -> Optional[str]:
    """The whole completion text, or None if the client hung up first (the generation is then abandoned)."""

    async def collect() -> str:
        return "".join([text async for text in gen.texts()])

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collector, watcher):
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    return collector.result() if not collector.cancelled() else None


# ------------------------------------------------------------ the app


class _RequestMetrics:
    """ASGI middleware counting /v1 answers by status and timing them to the last byte (streams included)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        endpoint = _ENDPOINT_OF_PATH.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})
        arrived, status = time.perf_counter(), 500

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            model = scope["state"].get("model", "unknown")  # set once the model name is known to be served
            metrics.REQUESTS.labels(model, endpoint, str(status)).inc()
            metrics.REQUEST_SECONDS.labels(model, endpoint).observe(time.perf_counter() - arrived)


def create_app(backend: GatewayBackend, site: SiteConfig) -> FastAPI:
    """The gateway's FastAPI app serving ``backend`` under ``site.gateway``'s limits and API keys."""
    tokenizer = ByteTokenizer()
    admission = Admission(site.gateway.max_queued_requests,
                          {g.name: g.max_concurrent_requests for g in site.quota_groups
                           if g.max_concurrent_requests is not None})
    group_of_key = {key: group.name for group in site.quota_groups for key in group.api_keys}

    app = FastAPI(title="exaserve-hpc gateway", version="0.1.0",
                  description="OpenAI-compatible API of an exaserve-hpc deployment (site "
                              f"{site.site!r}); see exaserve_hpc/router/openai_api.py for the supported subset.")
    app.add_middleware(_RequestMetrics)
    _install_error_handlers(app)

    def caller_group(request: Request) -> Optional[str]:
        """The quota group of the caller's API key; 401 when keys are required and this one is not known."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        group = group_of_key.get(key)
        if site.gateway.require_api_key and group is None:
            if not key:
                raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>' with your "
                               "group's key", code="missing_api_key")
            raise ApiError(401, "the API key given is not one of this site's keys; ask the site's platform "
                           "team for your group's key", code="invalid_api_key")
        return group

    def served_model(name: str, request: Request) -> ModelInfo:
        served = backend.models()
        for model in served:
            if model.name == name:
                request.state.model = name
                return model
        names = ", ".join(m.name for m in served) or "none (no replica is up yet)"
        raise ApiError(404, f"model {name!r} is not served here; served models: {names} (GET /v1/models)",
                       param="model", code="model_not_found")

    def fit_completion(model: ModelInfo, prompt_tokens: int, requested: Optional[int], field: str,
                       prompt_field: str) -> int:
        """Completion tokens to ask for: the request's, checked against max_seq_len, or the site default."""
        room = model.max_seq_len - prompt_tokens
        if room < 1:
            raise ApiError(400, f"{prompt_field} is {prompt_tokens} tokens, but model {model.name!r} has "
                           f"max_seq_len {model.max_seq_len}, which must also hold at least one completion "
                           f"token; shorten it to at most {model.max_seq_len - 1} tokens",
                           param=prompt_field, code="context_length_exceeded")
        if requested is None:
            return min(site.gateway.default_max_tokens, room)
        if requested > room:
            raise ApiError(400, f"{field} is {requested}, but the prompt is {prompt_tokens} tokens and model "
                           f"{model.name!r} has max_seq_len {model.max_seq_len} (prompt + {field} = "
                           f"{prompt_tokens + requested}); ask for at most {room}",
                           param=field, code="context_length_exceeded")
        return requested

    async def generate(request: Request, endpoint: str, body: api.GenerationParams, model: ModelInfo,
                       prompt_ids: list[int], max_tokens: int, group: Optional[str]) -> Response:
        arrived = time.perf_counter()
        ticket = admission.admit(group)
        metrics.PROMPT_TOKENS.labels(model.name).inc(len(prompt_ids))
        gen_request = GenerateRequest(
            request_id=api.new_request_id(), model=model.name, prompt_token_ids=prompt_ids,
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            quota_group=group)
        rid = gen_request.request_id
        try:
            gen = Generation(backend, gen_request, body.stop_strings, ticket, arrived)
        except Exception as exc:  # a backend whose stream() fails before returning a generator
            ticket.release()
            log.exception("request %s could not be started", rid)
            return error_response(_internal(rid, exc), rid)
        streaming = False  # once True, the SSE body (or its background task) owns closing gen
        try:
            if body.stream:
                await gen.start()
                streaming = True
                return StreamingResponse(
                    _sse_events(endpoint, gen, body.include_usage), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": rid},
                    # Runs also when the client left before the body started, so the slot is freed.
                    background=BackgroundTask(gen.close))
            text = await _collect_unless_disconnected(request, gen)
            if text is None:
                return Response(status_code=499)  # nobody is listening; logged as "client closed request"
            return JSONResponse(_json_answer(endpoint, gen, text), headers={"X-Request-Id": rid})
        except BackendError as exc:
            return error_response(_from_backend(exc), rid)
        except Exception as exc:
            log.exception("request %s failed", rid)
            return error_response(_internal(rid, exc), rid)
        finally:
            if not streaming:
                await gen.close()

    @app.post("/v1/completions", response_model=None, summary="Complete a text prompt")
    async def completions(body: api.CompletionRequest, request: Request,
                          group: Optional[str] = Depends(caller_group)) -> Response:
        model = served_model(body.model, request)
        prompt_ids = tokenizer.encode(body.prompt)
        max_tokens = fit_completion(model, len(prompt_ids), body.max_tokens, "max_tokens", "prompt")
        return await generate(request, COMPLETIONS, body, model, prompt_ids, max_tokens, group)

    @app.post("/v1/chat/completions", response_model=None, summary="Answer a chat conversation")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request,
                               group: Optional[str] = Depends(caller_group)) -> Response:
        model = served_model(body.model, request)
        try:
            prompt_ids = tokenizer.encode(apply_chat_template(body.messages))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        requested, field = body.completion_limit
        max_tokens = fit_completion(model, len(prompt_ids), requested, field, "messages")
        return await generate(request, CHAT, body, model, prompt_ids, max_tokens, group)

    @app.get("/v1/models", summary="List the served models")
    async def list_models(group: Optional[str] = Depends(caller_group)) -> dict:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by,
             "max_model_len": m.max_seq_len} for m in backend.models()]}

    @app.get("/v1/exaserve/status", summary="Fleet status: controller, agents, replicas")
    async def fleet_status(group: Optional[str] = Depends(caller_group)) -> dict:
        return backend.status()

    @app.get("/health", summary="200 when requests can be served now, 503 otherwise")
    async def health() -> JSONResponse:
        if backend.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": "no replica is ready"}, 503,
                            {"Retry-After": "5"})

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; FastAPI's 422 for bad bodies becomes OpenAI's 400."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        malformed = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if malformed is not None:
            position = malformed.get("loc", ("body", "?"))[-1]
            reason = (malformed.get("ctx") or {}).get("error", "invalid JSON")
            return error_response(ApiError(
                400, f"malformed JSON in the request body at character {position}: {reason}; send one JSON "
                     "object, e.g. {\"model\": \"...\", \"prompt\": \"...\"}", code="invalid_json"))
        message, param = api.describe_validation_errors(errors)
        return error_response(ApiError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; this server serves /v1/models, "
                       "/v1/completions, /v1/chat/completions, /health, /metrics and /openapi.json")
        return error_response(ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(_internal("(before admission)", exc))
