"""The Ray Serve deployment: a FastAPI ingress over one engine, its staging queue and step loop.

`build_app(config)` gives a Serve application; `serve.run(build_app(config))` serves
POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
POST /tokenize, POST /detokenize (vLLM's shapes, pipeline/serve/tokens.py), GET /health and
GET /metrics (Prometheus text of all the app's replicas, pipeline/serve/snapshots.py), each
response naming its replica (`x-raypack-replica`). `build_app` is also Ray Serve's app
builder (`serve run pipeline.serve:build_app model=... num_replicas=2`).
The FastAPI app is built per replica (`__serve_build_asgi_app__`), around that replica's engine,
so nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.gc_pause import call_paused, freeze_heap, gc_paused

# A replica (and `raypack serve`) imports this module first: torch (through the service's
# requests), FastAPI and Ray Serve with the cyclic collector paused (actors/gc_pause.py:
# 1.85 -> 1.30 CPU-s).
with gc_paused():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from ray import serve
    from ray.serve.deployment import Application
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from packing.admission import AdmissionConfig
    from pipeline.serve.auth import check_api_key, load_api_keys
    from pipeline.serve.cli import serve_config_from_app_args
    from pipeline.serve.config import ServeConfig, prefix_routed
    from pipeline.serve.errors import APIError
    from pipeline.serve.fit import FRONT_NUM_CPUS, fit_to_cluster
    from pipeline.serve.front import PrefixFront, run_asgi
    from pipeline.serve.gate import AdmissionGate, arrival_of
    from pipeline.serve.guard import GuardMiddleware, guard_limits
    from pipeline.serve.metrics import ServeMetrics, app_snapshots
    from pipeline.serve.protocol import HealthResponse
    from pipeline.serve.replicas import DRAIN_CHECK_S, ReplicaHeader, Scope
    from pipeline.serve.router import PrefixAffinityRouter, RoutedRequest
    from pipeline.serve.service import OpenAIService, Prepared
    from pipeline.serve.snapshots import ReplicaSnapshot, render
    from pipeline.serve.staging import EngineLoop, step_thread
    from pipeline.serve.tokens import detokenize, model_card, tokenize

logger = logging.getLogger(__name__)

# OpenAI-style codes for the routing errors Starlette raises itself.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


Snapshots = Callable[[], Awaitable[list[ReplicaSnapshot]]]


def create_api(
    service: OpenAIService,
    api_keys: frozenset[str],
    metrics: Any = None,
    snapshots: Snapshots | None = None,
) -> FastAPI:
    """The FastAPI app over one service. `metrics` (a ServeMetrics) counts rejected requests;
    `snapshots` gives the replicas' metrics GET /metrics renders (no /metrics without it)."""
    api = FastAPI(
        title="raypack", summary="OpenAI-compatible serving", docs_url=None, redoc_url=None
    )
    config = service.config
    limits = guard_limits(config)
    on_reject = metrics.record_rejected if metrics is not None else None
    api.add_middleware(GuardMiddleware, limits=limits, on_reject=on_reject)  # type: ignore[arg-type]
    # outside the guard: a request the replica cannot take is answered before its body is read
    api.add_middleware(
        AdmissionGate,  # type: ignore[arg-type]
        loop=service.loop,
        retry_after_s=config.retry_after_s,
        on_reject=on_reject,
    )
    # Parsing, the chat template and tokenizing take up to seconds for a large body: off the
    # event loop, so streams and /health go on meanwhile (a few threads: it is CPU work).
    prepare_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")

    async def prepared_in_thread(prepare: Callable[[bytes], Prepared], body: bytes) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, prepare, body)

    async def in_thread(work: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, work)

    @api.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        if metrics is not None:
            metrics.record_rejected(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        error = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def authorized_body(request: Request) -> bytes:
        check_api_key(request.headers.get("authorization"), api_keys)
        return await request.body()  # GuardMiddleware has read it, within its size and time

    @api.get("/health")
    async def health() -> HealthResponse:
        if not service.loop.alive:
            raise APIError(503, "the engine loop is not running", type="server_error")
        return HealthResponse(
            waiting=service.loop.num_waiting,
            running=service.loop.num_running,
            policy=service.loop.controller.config.policy,
            threshold=service.loop.controller.threshold,
            aborted=service.loop.num_aborted,
        )

    if snapshots is not None:

        @api.get("/metrics")
        async def metrics_route(request: Request) -> Response:
            # no API key, as /health (and vLLM's /metrics)
            body, content_type = render(await snapshots(), request.headers.get("accept", ""))
            return Response(body, media_type=content_type)

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request.headers.get("authorization"), api_keys)
        return JSONResponse(service.models().model_dump())

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        check_api_key(request.headers.get("authorization"), api_keys)
        return JSONResponse(model_card(model_id, service.models().data[0]).model_dump())

    @api.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        body = await authorized_body(request)
        answer = await in_thread(
            lambda: tokenize(
                body,
                service.tokenizer,
                config.model_name,
                service.max_model_len,
                allow_special_tokens_in_messages=config.allow_special_tokens_in_messages,
            )
        )
        return JSONResponse(answer.model_dump(exclude_none=True))

    @api.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        body = await authorized_body(request)
        answer = await in_thread(
            lambda: detokenize(body, service.tokenizer, config.model_name, service.vocab_size)
        )
        return JSONResponse(answer.model_dump())

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await authorized_body(request)
        prepared = await prepared_in_thread(service.prepare_completion, body)
        return await _answer(service, prepared, arrival_of(request.scope))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await authorized_body(request)
        prepared = await prepared_in_thread(service.prepare_chat, body)
        return await _answer(service, prepared, arrival_of(request.scope))

    return api


async def _answer(service: OpenAIService, prepared: Any, arrival: float | None) -> Response:
    stream = service.submit(prepared, arrival)
    if prepared.stream:
        return StreamingResponse(
            service.events(prepared, stream), media_type="text/event-stream", headers=_SSE_HEADERS
        )
    body = await service.respond(prepared, stream)
    return JSONResponse(body.model_dump())


@serve.deployment(
    name="raypack-openai", health_check_timeout_s=60, graceful_shutdown_wait_loop_s=DRAIN_CHECK_S
)
@serve.ingress()
class OpenAIDeployment:
    """One replica: an engine, its staging queue and admission controller, and the HTTP API."""

    def __init__(self, config: ServeConfig) -> None:
        from actors import LLMEngine  # torch loads in the replica, not in the driver

        self._config = config
        # builds the engine, then steps it (EngineLoop), on the fitted torch threads (fit.py)
        self._step_thread = step_thread(config.torch_threads)
        self._engine = self._step_thread.submit(call_paused, LLMEngine, config.engine).result()
        freeze_heap()  # the replica keeps this heap for its life (actors/gc_pause.py)
        self._api_keys = load_api_keys(config.api_keys_env, config.api_keys_file)
        self._metrics = ServeMetrics()
        self._admission = config.admission
        self._loop: EngineLoop | None = None
        self._api: FastAPI | None = None
        self._replica = ""
        self._siblings: Any = None  # this deployment's handle, for /metrics without a front
        logger.info("serving %s (max_model_len %d)", config.model_name, self._engine.max_model_len)

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Start the step loop on the replica's event loop and build the API around it."""
        self._loop = EngineLoop(
            self._engine,
            self._admission,
            max_waiting=self._config.max_waiting,
            max_running=self._config.engine.max_num_seqs,
            max_queue_wait_s=self._config.max_queue_wait_s,
            metrics=self._metrics,
            executor=self._step_thread,
        )
        self._loop.start()
        service = OpenAIService(
            self._config,
            self._loop,
            self._engine.tokenizer,
            self._engine.max_model_len,
            self._engine.vocab_size,
            self._engine.sampling_defaults,
        )
        api = create_api(service, self._api_keys, self._metrics, self._app_snapshots)
        # outermost: even the guard's own 4xx name the replica that answered
        self._replica = serve.get_replica_context().replica_id.unique_id
        api.add_middleware(ReplicaHeader, replica=self._replica)  # type: ignore[arg-type]
        self._api = api
        return api

    async def routed(self, request: RoutedRequest) -> AsyncIterator[Scope]:
        """A request the front passed on (prefix routing): run it through this replica's API
        and stream the ASGI messages back."""
        if self._api is None:
            raise RuntimeError("the replica's API is not built yet")
        async for message in run_asgi(self._api, request):
            yield message

    async def metrics_snapshot(self) -> ReplicaSnapshot:
        """This replica's metrics now (GET /metrics merges those of every replica)."""
        if self._loop is None:
            raise RuntimeError("the replica's engine loop is not started yet")
        kvs = self._engine.scheduler.kvs
        blocks = sum(kv.num_blocks for kv in kvs)
        used = sum(kv.num_blocks - kv.num_free_blocks for kv in kvs)
        return self._metrics.recorder.snapshot(
            self._replica,
            self._config.model_name,
            running=self._loop.num_running,
            waiting=self._loop.num_waiting,
            kv_usage=used / blocks if blocks else 0.0,
            kv_blocks=blocks,
            num_preemptions=self._engine.stats.num_preemptions,
        )

    async def _app_snapshots(self) -> list[ReplicaSnapshot]:
        """What this replica's /metrics renders: its own snapshot when the app has one replica,
        else every replica's through this deployment's handle (with a front, the front answers
        /metrics itself the same way)."""
        if self._config.replicas.highest == 1:
            return [await self.metrics_snapshot()]
        if self._siblings is None:
            context = serve.get_replica_context()
            self._siblings = serve.get_deployment_handle(context.deployment, context.app_name)
        return await app_snapshots(self._siblings)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's user_config hook: `{"admission": {AdmissionConfig fields}}` switches the
        admission rule in place (no restart, the model stays loaded)."""
        unknown = set(user_config) - {"admission"}
        if unknown:
            raise ValueError(f"user_config accepts only 'admission', got {sorted(unknown)}")
        if "admission" in user_config:
            self._admission = AdmissionConfig(**user_config["admission"])
            if self._loop is not None:
                self._loop.set_admission(self._admission)

    def check_health(self) -> None:
        """Serve's health check: the step loop must be running."""
        if self._loop is not None and not self._loop.alive:
            raise RuntimeError("the engine step loop stopped")


def build_app(args: ServeConfig | Mapping[str, Any]) -> Application:
    """The Serve application: `config.replicas` replicas, each owning one engine.

    Also Ray Serve's app builder: given a dict of arguments (what `serve run
    pipeline.serve:build_app model=... num_replicas=2` passes, or `args:` in a `serve deploy`
    config file), each `key=value` is the flag `--key value` of `raypack serve`
    (pipeline/serve/cli.py), so the command, `serve run` and `serve deploy` build one app.

    To switch the admission rule of the live replicas without reloading the model, call
    `serve.get_app_handle(name).reconfigure.remote({"admission": {...}})` (or set
    `user_config` in a `serve deploy` config file, which Serve applies in place).
    """
    if isinstance(args, ServeConfig):
        config = args
    else:
        config = serve_config_from_app_args(args)
    # The replicas' CPUs fitted to the cluster, or a ValueError naming the flags: Serve itself
    # would wait for CPUs that are not there forever (pipeline/serve/fit.py).
    config = fit_to_cluster(config, prefix_routed(config))
    deployment = OpenAIDeployment.options(  # type: ignore[attr-defined]
        max_ongoing_requests=config.ongoing_limit,
        **backpressure_options(config, config.queued_limit),
        **replica_options(config),
        **placement_options(config),
        **routing_options(config),
    )
    app: Application = deployment.bind(config)
    if not prefix_routed(config):
        return app
    front = PrefixFront.options(  # type: ignore[attr-defined]
        max_ongoing_requests=config.ongoing_limit * config.replicas.highest,
        **backpressure_options(config, front_queued_limit(config)),
        ray_actor_options={"num_cpus": FRONT_NUM_CPUS},
    )
    routed: Application = front.bind(app, guard_limits(config))
    return routed


def backpressure_options(config: ServeConfig, max_queued: int) -> dict[str, Any]:
    """Serve's back-pressure for a deployment: at most `max_queued` requests wait at each
    caller (the proxy, the front's handle) for a replica with room; one more is answered 503
    with Retry-After (`retry_after_s`) by Serve at once."""
    from ray.serve.config import BackpressureConfig

    return {
        "max_queued_requests": max_queued,
        "backpressure_config": BackpressureConfig(
            status_code=503, retry_after_s=config.retry_after_s
        ),
    }


def front_queued_limit(config: ServeConfig) -> int:
    """Serve's max_queued_requests for the routing front: the engine deployment's by default
    (already all replicas' room), times the replicas for an operator's per-replica bound."""
    limit = config.queued_limit
    if config.max_queued_requests is None or limit == -1:
        return limit
    return limit * config.replicas.highest


def routing_options(config: ServeConfig) -> dict[str, Any]:
    """Serve's request router for the engine replicas: PrefixAffinityRouter when the app
    routes by prefix (the front calls them), falling back to Serve's default when a match is
    under two chunks (512 characters) or its replica has max_num_seqs requests in progress."""
    if not prefix_routed(config):
        return {}
    from ray.serve.config import RequestRouterConfig

    return {
        "request_router_config": RequestRouterConfig(
            request_router_class=f"{PrefixAffinityRouter.__module__}.PrefixAffinityRouter",  # type: ignore[arg-type]
            request_router_kwargs={"saturated_at": config.engine.max_num_seqs},
        )
    }


def replica_options(config: ServeConfig) -> dict[str, Any]:
    """Serve options for the replicas: their count (fixed, or an `autoscaling_config` aiming
    at the engine's max_num_seqs requests in progress unless told otherwise) and each one's
    resources (`num_cpus`; one GPU when its single-process engine runs on CUDA; a tp x pp
    engine's GPUs are in its workers' bundles, placement_options), and its malloc (a
    `runtime_env` preloading tcmalloc where the machine has it: actors/allocator.py)."""
    from actors.allocator import preload_env

    actor: dict[str, Any] = {"num_cpus": config.num_cpus}
    if config.engine.world_size == 1 and _uses_gpu(config.engine.device):
        actor["num_gpus"] = 1
    env = preload_env(config.allocator)
    if env:
        actor["runtime_env"] = {"env_vars": env}
    return {
        "ray_actor_options": actor,
        **config.replicas.deployment_options(default_target=config.engine.max_num_seqs),
    }


def placement_options(config: ServeConfig) -> dict[str, Any]:
    """Serve options that reserve a tp x pp engine's workers with its replica.

    The replica gets a placement group of one bundle per worker (stage-major, the replica's own
    CPUs added to bundle 0, where Serve puts the replica) and its engine places worker i in
    bundle i of that group (actors.parallel.executor), so each replica holds a whole engine, a
    replica starts only where all of its workers fit, and the group goes with the replica.
    A single-process engine needs none of this.
    """
    engine = config.engine
    if engine.world_size == 1:
        return {}
    from actors.parallel import placement

    return {
        "placement_group_bundles": placement.worker_bundles(
            engine.world_size,
            engine.worker_num_cpus,
            _uses_gpu(engine.device),
            engine_share={"CPU": config.num_cpus},
        ),
        # tp alone is one collective group: all on one node, as the engine does for itself
        "placement_group_strategy": (
            "STRICT_PACK" if engine.pipeline_parallel_size == 1 else engine.placement_strategy
        ),
    }


def _uses_gpu(device: str | None) -> bool:
    """Whether the engine's workers take a GPU: its device, or (unset) whether Ray has one."""
    if device is not None:
        return device.startswith("cuda")
    import ray

    return ray.is_initialized() and bool(ray.cluster_resources().get("GPU"))
