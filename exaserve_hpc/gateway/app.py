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

import hmac
import logging
import time
from typing import Optional

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from exaserve_hpc import metrics
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.engine.hf_tokenizer import ModelTokenizer, TokenizerError
from exaserve_hpc.gateway import openai_api as api
from exaserve_hpc.gateway.admission import (
    Admission, ApiError, BodyLimit, error_response, from_backend_error, internal_error
)
from exaserve_hpc.gateway.backend import BackendError, GatewayBackend, ModelInfo
from exaserve_hpc.gateway.generation import (
    CHAT, COMPLETIONS, Generation, StopGate, collect_unless_disconnected, json_answer, sse_events
)
from exaserve_hpc.gateway.model_tokenizers import ModelTokenizers
from exaserve_hpc.observability import logs
from exaserve_hpc.observability.collector import render_metrics
from exaserve_hpc.protocol import GenerateRequest
from exaserve_hpc.quota.keys import KeyRing, plaintext_warnings
from exaserve_hpc.quota.shares import GroupShare, SharePolicy
from exaserve_hpc.router.policies import policy_class

log = logging.getLogger(__name__)

_ENDPOINT_OF_PATH = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "/v1/models": "models",
                     "/v1/exaserve/status": "status"}


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


def group_limits(site: SiteConfig) -> dict[str, int]:
    """Each quota group's cap on requests in flight: its own max_concurrent_requests, else (when several
    groups share the gateway) gateway.group_share of max_queued_requests, so no group takes every slot."""
    gateway, groups = site.gateway, site.quota_groups
    share = max(1, int(gateway.group_share * gateway.max_queued_requests))
    return {g.name: g.max_concurrent_requests if g.max_concurrent_requests is not None else share
            for g in groups if g.max_concurrent_requests is not None or len(groups) > 1}


def gpu_share(site: SiteConfig) -> dict[str, float]:
    """GPU-seconds one second of a request costs, per model: a replica's GPUs over its batch slots."""
    return {m.model_name: m.tensor_parallel * m.pipeline_parallel / site.max_batch_size(m) for m in site.models}


def share_policy(site: SiteConfig) -> dict:
    """Admission's capacity (each model's configured replicas x batch slots; a model scaled up or down is not
    followed yet: the groups' share-use gauges divide by it too) and, when any quota group has a
    guaranteed_share, the shares."""
    capacity = {m.model_name: max(1, site.initial_replicas(m)) * site.max_batch_size(m) for m in site.models}
    if not any(g.guaranteed_share is not None for g in site.quota_groups):
        return dict(capacity=capacity)
    shares = {g.name: GroupShare(g.guaranteed_share or 0.0, g.burst_share) for g in site.quota_groups}
    return dict(shares=SharePolicy(shares, site.gateway.fair_share_half_life), capacity=capacity)


def site_admission(site: SiteConfig, ledger=None, part: tuple[int, int] = (0, 1)) -> Admission:
    """The admission of the site's limits and quota groups. ``part``: (this gateway, gateways) when each of
    several gateways on different ranks holds a part of every limit (gateway/admission.py); a gateway
    process serving several gateways gives them all the one Admission this returns."""
    admission = Admission(site.gateway.max_queued_requests, group_limits(site),
                          {g.name: g.tokens_per_minute for g in site.quota_groups if g.tokens_per_minute is not None},
                          ledger=ledger, accounts={g.name: g.account or "" for g in site.quota_groups},
                          gpu_share=gpu_share(site), part=part, **share_policy(site))
    if ledger is not None and admission.shares is not None:  # fair share continues across a restart
        ledger.seed(admission.shares, admission.clock())  # the ledger restored the earlier runs' usage
    return admission


def create_app(backend: GatewayBackend, site: SiteConfig, admin_routes: Optional[APIRouter] = None,
               admin_key: Optional[str] = None, ledger=None, admission: Optional[Admission] = None) -> FastAPI:
    """The gateway's FastAPI app serving ``backend`` under ``site.gateway``'s limits and API keys.

    ``admin_routes`` (e.g. the router's rollout API) are mounted as they are; they carry their own auth.
    ``admin_key``: the deployment's admin key; with gateway.require_api_key, fleet status, /metrics and
    /openapi.json need it (/metrics also takes gateway.metrics_key).
    ``ledger``: a quota.ledger.UsageLedger every finished request is recorded in (None: not recorded).
    ``admission``: shared with other gateways (``site_admission``); default, this app's own over ``ledger``.
    """
    tokenizers = ModelTokenizers(site)
    admission = admission if admission is not None else site_admission(site, ledger)
    keyring = KeyRing.from_site(site)  # hashes only; a key file open to others is refused here
    for warning in plaintext_warnings(site):
        log.warning("%s", warning)
    # Private models: model name -> the groups that may see it (absent: everyone).
    visible_to = {m.model_name: set(m.visible_to) for m in site.models if m.visible_to is not None}
    # Prompts are hashed here, in the gateway processes, so the router's one thread only looks them up.
    hasher = policy_class(site.router.policy).prompt_hasher(site.router)
    keyed = site.gateway.require_api_key
    # Models that scale from zero wait for their first replica; any other gets 503 at once while none serves.
    from_zero = {m.model_name for m in site.models if site.min_replicas(m) == 0}
    readiness = [0.0, False]  # (checked at, ready): backend.ready() takes the fleet's lock; ask at most every 0.2 s

    app = FastAPI(title="exaserve-hpc gateway", version="0.1.0",
                  description="OpenAI-compatible API of an exaserve-hpc deployment (site "
                              f"{site.site!r}); see exaserve_hpc/gateway/openai_api.py for the supported subset.",
                  # With keys required the schema is served by the keyed route below, and no docs pages.
                  **(dict(openapi_url=None, docs_url=None, redoc_url=None) if keyed else {}))
    # The open generations, which a stop ends cleanly after gateway.stop_grace (app/routing.py)
    gate = app.state.stop_gate = StopGate()
    app.add_middleware(BodyLimit, limit=site.gateway.max_body_bytes)
    app.add_middleware(_RequestMetrics)
    _install_error_handlers(app)
    if admin_routes is not None:
        app.include_router(admin_routes)

    async def caller_group(request: Request) -> Optional[str]:
        """The quota group of the caller's API key; 401 when keys are required and this one is not known.
        async: FastAPI runs a plain `def` dependency in a worker thread, a hand-off that cost a fifth of the
        gateway's event-loop time per request (profiled) for a dictionary lookup."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        group = keyring.group_of(key)
        if site.gateway.require_api_key and group is None:
            if not key:
                raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>' with your "
                               "group's key", code="missing_api_key")
            raise ApiError(401, "the API key given is not one of this site's keys; ask the site's platform "
                           "team for your group's key", code="invalid_api_key")
        return group

    def bearer(request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        return key.strip() if scheme.lower() == "bearer" else ""

    def require_key(request: Request, *accepted: Optional[str], what: str, which: str) -> None:
        """With keys required, one of the accepted keys or 401."""
        if not keyed:
            return
        given = bearer(request).encode()
        if not any(key and hmac.compare_digest(given, key.encode()) for key in accepted):
            raise ApiError(401, f"{what} needs 'Authorization: Bearer <key>' with {which}", code="invalid_api_key")

    def serving_now() -> bool:
        now = time.monotonic()
        if now - readiness[0] > 0.2:
            readiness[:] = [now, bool(backend.ready())]
        return readiness[1]

    def visible(model_name: str, group: Optional[str]) -> bool:
        allowed = visible_to.get(model_name)
        return allowed is None or group in allowed

    def served_model(name: str, request: Request, group: Optional[str]) -> ModelInfo:
        # A private model is answered exactly as an unknown one: others learn nothing of it.
        served = [m for m in backend.models() if visible(m.name, group)]
        for model in served:
            if model.name == name:
                request.state.model = name
                return model
        names = ", ".join(m.name for m in served) or "none (no replica is up yet)"
        raise ApiError(404, f"model {name!r} is not served here; served models: {names} (GET /v1/models)",
                       param="model", code="model_not_found")

    def tokenizer_of(model: ModelInfo) -> ModelTokenizer:
        try:
            return tokenizers.get(model.name)
        except TokenizerError as exc:  # the checkpoint's tokenizer files: the operator's to fix, not the caller's
            log.error("model %s: %s", model.name, exc)
            raise ApiError(503, f"model {model.name!r} cannot tokenize requests now: {exc}",
                           code="tokenizer_unavailable", retry_after=30) from exc

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
                       prompt_ids: list[int], max_tokens: int, group: Optional[str],
                       tokenizer: ModelTokenizer) -> Response:
        arrived = time.perf_counter()
        if gate.stopping:
            raise ApiError(503, "this server is stopping and takes no new requests; retry after the Retry-After "
                           "seconds (at its successor, or another gateway)", code="server_stopping", retry_after=5)
        if model.name not in from_zero and not serving_now():
            # What /health says: waiting for a replica would only end in a 503 after first_token_timeout.
            raise ApiError(503, f"no replica is serving now (GET /health is 503); model {model.name!r} "
                           "cannot be answered until one is; retry after the Retry-After seconds",
                           code="no_replica", retry_after=5)
        rid = api.new_request_id()
        ticket = admission.admit(group, model.name, len(prompt_ids), rid)
        metrics.PROMPT_TOKENS.labels(model.name).inc(len(prompt_ids))
        gen_request = GenerateRequest(
            request_id=rid, model=model.name, prompt_token_ids=prompt_ids,
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            quota_group=group, prefix_hashes=hasher(prompt_ids) if hasher else [],
            stop_token_ids=sorted(tokenizer.eos_token_ids),
            prefix_scheme=hasher.scheme if hasher else "")
        logs.REQUEST_ID.set(rid)  # this task's log lines carry it (--log-format json)
        try:
            gen = Generation(backend, gen_request, body.stop_strings, ticket, arrived, tokenizer.incremental(),
                             gate=gate)
        except Exception as exc:  # a backend whose stream() fails before returning a generator
            ticket.release()
            log.exception("request %s could not be started", rid)
            return error_response(internal_error(rid, exc), rid)
        streaming = False  # once True, the SSE body (or its background task) owns closing gen
        try:
            if body.stream:
                await gen.start()
                streaming = True
                return StreamingResponse(
                    sse_events(endpoint, gen, body.include_usage), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": rid},
                    # Runs also when the client left before the body started, so the slot is freed.
                    background=BackgroundTask(gen.close))
            text = await collect_unless_disconnected(request, gen)
            if text is None:
                return Response(status_code=499)  # nobody is listening; logged as "client closed request"
            return JSONResponse(json_answer(endpoint, gen, text), headers={"X-Request-Id": rid})
        except BackendError as exc:
            return error_response(from_backend_error(exc), rid)
        except Exception as exc:
            log.exception("request %s failed", rid)
            return error_response(internal_error(rid, exc), rid)
        finally:
            if not streaming:
                await gen.close()
            log.debug("request %s (%s, group %s): %d prompt tokens, %s", rid, model.name, group, len(prompt_ids),
                      "streaming" if streaming else f"{gen.completion_tokens} completion tokens")

    @app.post("/v1/completions", response_model=None, summary="Complete a text prompt")
    async def completions(body: api.CompletionRequest, request: Request,
                          group: Optional[str] = Depends(caller_group)) -> Response:
        model = served_model(body.model, request, group)
        tokenizer = tokenizer_of(model)
        prompt_ids = tokenizer.encode(body.prompt, add_special_tokens=True)
        if not prompt_ids:
            raise ApiError(400, "prompt is empty and this model's tokenizer adds no BOS token; send some text",
                           param="prompt", code="invalid_value")
        max_tokens = fit_completion(model, len(prompt_ids), body.max_tokens, "max_tokens", "prompt")
        return await generate(request, COMPLETIONS, body, model, prompt_ids, max_tokens, group, tokenizer)

    @app.post("/v1/chat/completions", response_model=None, summary="Answer a chat conversation")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request,
                               group: Optional[str] = Depends(caller_group)) -> Response:
        model = served_model(body.model, request, group)
        tokenizer = tokenizer_of(model)
        try:  # the model's own chat template; its raise_exception (e.g. roles out of order) is the caller's 400
            prompt_ids = tokenizer.encode_chat(body.messages, add_generation_prompt=True)
        except TokenizerError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from exc
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        if not prompt_ids:
            raise ApiError(400, "messages render to an empty prompt with this model's chat template",
                           param="messages", code="invalid_value")
        requested, field = body.completion_limit
        max_tokens = fit_completion(model, len(prompt_ids), requested, field, "messages")
        return await generate(request, CHAT, body, model, prompt_ids, max_tokens, group, tokenizer)

    @app.get("/v1/models", summary="List the served models")
    async def list_models(group: Optional[str] = Depends(caller_group)) -> dict:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by,
             "max_model_len": m.max_seq_len} for m in backend.models() if visible(m.name, group)]}

    @app.get("/v1/exaserve/status", summary="Fleet status: controller, agents, replicas")
    async def fleet_status(request: Request) -> dict:
        require_key(request, admin_key, what="fleet status", which="the deployment's admin key "
                    "(quota groups' keys do not see the fleet)")
        return backend.status()

    if keyed:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_schema(request: Request) -> JSONResponse:
            if keyring.group_of(bearer(request)) is None:
                require_key(request, admin_key, what="/openapi.json", which="one of this site's API keys")
            return JSONResponse(app.openapi())

    @app.get("/health", summary="200 when requests can be served now, 503 otherwise")
    async def health() -> JSONResponse:
        if gate.stopping:
            return JSONResponse({"status": "unavailable", "reason": "stopping"}, 503, {"Retry-After": "5"})
        if backend.ready():
            return JSONResponse({"status": "ok"})
        try:  # a stopped controller or router thread is named (Controller.liveness via its status)
            down = (backend.status().get("controller") or {}).get("liveness")
        except Exception:
            down = None
        reason = "; ".join(down) if isinstance(down, list) and down else "no replica is ready"
        return JSONResponse({"status": "unavailable", "reason": reason}, 503, {"Retry-After": "5"})

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus_metrics(request: Request) -> Response:
        require_key(request, site.gateway.metrics_key, admin_key, what="/metrics",
                    which="gateway.metrics_key or the deployment's admin key")
        # Off the event loop: a target-scale fleet takes a few hundred ms to render (bench_metrics_scrape.py);
        # gzipped for Prometheus (it asks), 6.9 MB -> 0.6 MB at 3,072 replicas.
        gzipped = "gzip" in request.headers.get("accept-encoding", "")
        body, content_type = await anyio.to_thread.run_sync(render_metrics, gzipped)
        encoding = {"Content-Encoding": "gzip"} if gzipped else {}
        return Response(body, headers={"Content-Type": content_type, **encoding})

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
        if exc.status_code == 404 and message == "Not Found":  # no such route (a route's own 404 says more)
            message = (f"no route {request.method} {request.url.path}; this server serves /v1/models, "
                       "/v1/completions, /v1/chat/completions, /health, /metrics and /openapi.json")
        return error_response(ApiError(exc.status_code, message, code=getattr(exc, "code", None)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(internal_error("(before admission)", exc))
