"""The Tinker API over HTTP (FastAPI): the routes the `tinker` SDK calls, on tenants hosted in Ray actors.

Served (docs/service.md has the full table of what the SDK calls and what is refused):
    GET  /api/v1/healthz, /api/v1/get_server_capabilities
    POST /api/v1/client/config, /api/v1/client/dynamic_config, /api/v1/telemetry
    POST /api/v1/create_session, /api/v1/session_heartbeat, /api/v1/sessions/{id}/finish
    GET  /api/v1/sessions, /api/v1/sessions/{id} (RestClient.list_sessions / get_session)
    POST /api/v1/create_model, /api/v1/get_info
    POST /api/v1/forward_backward (protobuf), /api/v1/optim_step
    POST /api/v1/save_weights_for_sampler, /api/v1/asample (cluster.serve.sampling)
    POST /api/v1/retrieve_future
    POST /api/v1/save_weights, /api/v1/load_weights, /api/v1/create_sampling_session, GET /api/v1/samplers/{id}
        (named checkpoints, per API key: cluster.serve.checkpoints)
Every /api/v1 route but healthz needs a configured key in `X-API-Key` (else 401). A session, its models
and their futures belong to the key that made them: another key is told they do not exist (404).
Finishing a session (`ServiceClient.close`) ends its tenants and samplers (`Service.release`); so does
a session whose heartbeats (the SDK sends one every 10 s) stop for longer than `session_timeout_s`
(`Service.expire`, run every quarter of it). Any
other route is a 404 naming it. Each tenant (a LoRA training client) is a `TenantModel` in a Ray actor
of its own (taken from a warm pool of loaded ones where `base_models[].warm` keeps one, and refused
at once when the cluster has no CPUs for it: `cluster.serve.pool`); its calls are ordered and applied
once by `cluster.serve.futures.FutureBook`, and a tenant whose actor dies is restored from its last
saved state (`cluster.serve.recovery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from cluster.serve.answers import error
from cluster.serve.checkpoint_routes import add_routes, save_named_sampler
from cluster.serve.checkpoints import CheckpointPath, CheckpointStore, checkpoint_name
from cluster.serve.config import ServeConfig
from cluster.serve.futures import Done, Failed, FutureBook, UserError
from cluster.serve.pool import Held, WarmPool
from cluster.serve.recovery import Tenant
from cluster.serve.sampling import SampleBody, Samplers, sample_call
from cluster.serve.tenant import AdamStep, TenantModel
from cluster.serve.tenant_metrics import TenantMetrics
from cluster.serve.wire import WireError, decode_forward_backward, encode_output
from learner.config_blocks import LoRAConfig

PROTOBUF = "application/x-protobuf"
SERVED = [
    "GET /api/v1/healthz", "GET /api/v1/get_server_capabilities", "POST /api/v1/client/config",
    "POST /api/v1/client/dynamic_config", "POST /api/v1/telemetry", "POST /api/v1/create_session",
    "POST /api/v1/session_heartbeat", "POST /api/v1/sessions/{id}/finish", "GET /api/v1/sessions",
    "GET /api/v1/sessions/{id}", "POST /api/v1/create_model",
    "POST /api/v1/get_info", "POST /api/v1/forward_backward", "POST /api/v1/optim_step",
    "POST /api/v1/save_weights_for_sampler", "POST /api/v1/asample", "POST /api/v1/retrieve_future",
    "POST /api/v1/save_weights", "POST /api/v1/load_weights", "POST /api/v1/create_sampling_session",
    "GET /api/v1/samplers/{id}", "GET /api/v1/training_runs/{id}/checkpoints",
]  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())  # the SDK adds fields over versions


class _Lora(_Body):
    rank: int = Field(gt=0)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class _CreateModel(_Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: _Lora | None = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})


class _Adam(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class _OptimStep(_Body):
    model_id: str
    seq_id: int | None = None
    adam_params: _Adam | None = None
    optimizer_params: dict[str, Any] | None = None


class _SaveForSampler(_Body):
    model_id: str
    seq_id: int | None = None
    path: str | None = None
    kind: str = "snapshot"


class _Retrieve(_Body):
    request_id: str


@dataclasses.dataclass
class Session:
    owner: str
    last_beat: float  # time.monotonic() of its creation or its latest heartbeat
    ended: str | None = None  # why it ended (its client finished it, or its heartbeats stopped)


class Service:
    """What the routes share: the config, sessions, tenants and the futures."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.sessions: dict[str, Session] = {}
        self.tenants: dict[str, Tenant] = {}
        self.book = FutureBook(config.order_wait_s, config.call_timeout_s)
        self.actor_class = ray.remote(num_cpus=config.tenant_cpus)(TenantModel)
        self.samplers = Samplers(config.tenant_cpus, config.sampling_rollout(), config.start_timeout_s)
        self.checkpoints = CheckpointStore(config.checkpoint_dir)
        self.pool = WarmPool(config, self.actor_class, self.held)  # filled when the app starts (`build_app`)
        self.metrics = TenantMetrics(config.tracking)  # one tracker run per tenant

    def held(self) -> Held:
        """The service's actors that hold `tenant_cpus` each (admission, `cluster.serve.pool`)."""
        samplers = sum(1 for slot in self.samplers.slots.values() if slot.engine is not None)
        return Held(len(self.tenants) + self.pool.starting, self.pool.size(), samplers)

    def end(self, session_id: str, why: str) -> None:
        """Mark a session ended (`why` is what its heartbeat and lookups answer from then on) and release
        its tenants and samplers."""
        self.sessions[session_id].ended = why
        self.release(session_id)

    def expire(self, now: float) -> list[str]:
        """End every live session whose latest heartbeat (or creation) is more than `session_timeout_s`
        before `now` (time.monotonic()); their ids."""
        limit = self.config.session_timeout_s
        late = [sid for sid, s in self.sessions.items() if s.ended is None and now - s.last_beat > limit]
        for sid in late:
            self.end(sid, f"no heartbeat for more than {limit:g}s (session_timeout_s)")
        return late

    async def watch_heartbeats(self) -> None:
        """`expire` every quarter of `session_timeout_s`, for as long as the service runs."""
        while True:
            await asyncio.sleep(self.config.session_timeout_s / 4)
            self.expire(time.monotonic())

    def release(self, session_id: str) -> None:
        """End a finished session's tenants and samplers: their Ray actors (and CPUs) go, an engine still
        starting too, their pending futures fail saying the session ended (a released tenant is never
        recovered), and their ids are unknown from then on."""
        for model_id in [m for m, t in self.tenants.items() if t.session_id == session_id]:
            ray.kill(self.tenants.pop(model_id).actor)
            self.metrics.close(model_id)
        self.samplers.release(session_id)
        self.pool.refill()  # CPUs freed: the warm pool's missing actors start

    def tenant(self, model_id: str, owner: str) -> Tenant:
        t = self.tenants.get(model_id)
        if t is None or t.owner != owner:
            raise UserError(f"unknown model_id {model_id!r}")
        return t

    async def create_model(self, req: _CreateModel, owner: str) -> Done:
        session = self.sessions.get(req.session_id)
        if session is None or session.owner != owner:
            raise UserError(f"unknown session_id {req.session_id!r}")
        self.config.base_model(req.base_model)  # an unknown name raises, naming the served ones
        if req.lora_config is None:
            raise UserError("create_model without lora_config (full fine-tuning) is not served; LoRA only")
        lora = req.lora_config
        off = [f for f in ("train_mlp", "train_attn", "train_unembed") if not getattr(lora, f)]
        if off:
            raise UserError(f"lora_config {off}=False is not served: adapters go on lora_target_modules")
        if req.optimizer_config.get("type") != "adamw":
            raise UserError(f"optimizer_config {req.optimizer_config!r}: only adamw is served")
        seed = self.config.seed if lora.seed is None else lora.seed
        model_id = await self.start_tenant(
            owner, req.session_id, req.model_seq_id, req.base_model, lora.rank, seed
        )
        return Done({"model_id": model_id, "type": "create_model"})

    async def new_actor(self, base_model: str, rank: int, seed: int) -> Any:
        """A `TenantModel` actor for `base_model` with a rank-`rank` adapter (LoRA init `seed`), loaded
        (or its load error raised): a warm pool actor's if one waits (`cluster.serve.pool`), else a new one."""
        actor, _pooled = await self.pool.start(base_model, self._lora(rank), seed)
        return actor

    def _lora(self, rank: int) -> LoRAConfig:
        return LoRAConfig(
            rank=rank, alpha=self.config.lora_alpha, target_modules=self.config.lora_target_modules
        )

    async def start_tenant(
        self, owner: str, session_id: str, model_seq_id: int, base_model: str, rank: int, seed: int
    ) -> str:
        """A tenant's actor, loaded (or its load error raised); its model_id. With no warm pool actor to
        take and no CPUs for a new one, refused at once (`WarmPool.admit`)."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if not self.pool.waiting[base_model]:
            self.pool.admit()
        actor, pooled = await self.pool.start(base_model, self._lora(rank), seed)
        ended = self.sessions[session_id].ended
        if ended:  # it ended while the actor loaded: nothing would release a tenant registered now
            ray.kill(actor)
            raise UserError(f"session {session_id!r} has ended: {ended}")
        self.tenants[model_id] = Tenant(model_id, owner, session_id, base_model, rank, seed, actor)
        about = {"base_model": base_model, "lora_rank": rank, "seed": seed, "session_id": session_id}
        self.metrics.start(owner, model_id, about)
        how = "a warm pool actor" if pooled else "a new actor (cold start)"
        print(f"tenant {model_id} ({base_model}, rank {rank}, seed {seed}): {how}", flush=True)
        return model_id


def build_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        watcher = asyncio.create_task(service.watch_heartbeats())
        service.pool.refill()  # the warm pool's actors start loading (after `serving <url>` is printed)
        yield
        watcher.cancel()

    app = FastAPI(title="rayppo Tinker service", lifespan=lifespan)
    cfg = service.config

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        guarded = path.startswith("/api/") and path != "/api/v1/healthz"
        if guarded and request.headers.get("x-api-key") not in cfg.api_keys:
            return error(401, "missing or unknown API key (X-API-Key)")
        return await call_next(request)

    def owner(request: Request) -> str:
        return request.headers["x-api-key"]

    def future(request: Request, work, model_id=None, seq_id=None, samples: int = 0) -> JSONResponse:
        key = request.headers.get("x-idempotency-key")
        rid = service.book.submit(owner(request), work, key, model_id, seq_id)
        answer = {"request_id": rid, "model_id": model_id}
        if samples:  # a sample's future names its sequences (SampledSequence.sequence_id)
            answer["sample_sequence_ids"] = [f"{rid}:{i}" for i in range(samples)]
        return JSONResponse(answer)

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        models = [{"model_name": e.name, "trainable": True, "sampleable": True} for e in cfg.base_models]
        return {"supported_models": models}

    @app.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # the SDK's own telemetry: not kept

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        sid = str(uuid.uuid4())
        service.sessions[sid] = Session(owner(request), time.monotonic())
        return {"type": "create_session", "session_id": sid}

    def _tenant(request: Request, model_id: str) -> Tenant | JSONResponse:
        """The caller's tenant `model_id`, or the 404 to answer."""
        try:
            return service.tenant(model_id, owner(request))
        except UserError as e:
            return error(404, str(e))

    def _session(request: Request, sid: str) -> Session | JSONResponse:
        s = service.sessions.get(sid)
        if s is None or s.owner != owner(request):
            return error(404, f"unknown session_id {sid!r}")
        return error(410, f"session {sid!r} has ended: {s.ended}") if s.ended else s

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        s = _session(request, (await request.json()).get("session_id", ""))
        if isinstance(s, JSONResponse):
            return s
        s.last_beat = time.monotonic()
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{sid}/finish")
    async def finish(sid: str, request: Request):
        s = _session(request, sid)
        if isinstance(s, Session):
            service.end(sid, "its client finished it")
            return {}
        return s

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request, limit: int = 20, offset: int = 0):
        who = owner(request)
        live = [sid for sid, s in service.sessions.items() if s.owner == who and s.ended is None]
        return {"sessions": live[offset : offset + limit]}

    @app.get("/api/v1/sessions/{sid}")
    async def get_session(sid: str, request: Request):
        s = _session(request, sid)
        if isinstance(s, JSONResponse):
            return s
        runs = [m for m, t in service.tenants.items() if t.session_id == sid]
        samplers = [k for k, v in service.samplers.sessions.items() if v.session_id == sid]
        return {"training_run_ids": runs, "sampler_ids": samplers}

    @app.post("/api/v1/create_model")
    async def create_model(body: _CreateModel, request: Request):
        who = owner(request)
        return future(request, lambda: service.create_model(body, who))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        model_id = (await request.json()).get("model_id", "")
        t = _tenant(request, model_id)
        if isinstance(t, JSONResponse):
            return t
        path = cfg.base_model(t.base_model).path
        data = {"arch": "lora", "model_name": t.base_model, "tokenizer_id": path}
        return {"type": "get_info", "model_data": data, "model_id": model_id, "is_lora": True,
                "lora_rank": t.rank, "model_name": t.base_model}  # fmt: skip

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        if PROTOBUF not in request.headers.get("content-type", ""):
            return error(415, f"forward_backward takes {PROTOBUF} (the tinker SDK's wire format)")
        if request.headers.get("content-encoding"):
            return error(415, "compressed forward_backward bodies are not served (client/config says so)")
        try:
            req = decode_forward_backward(await request.body())
            tenant = service.tenant(req.model_id, owner(request))
        except (WireError, UserError) as e:
            return error(400, str(e))

        async def work() -> Done:
            out = await tenant.call(
                service, "forward_backward", req.data, req.loss_fn, req.loss_fn_config, req.forward_only
            )
            if req.forward_only:
                service.metrics.forward(req.model_id)
            else:
                tokens = sum(len(d.tokens) for d in req.data)
                service.metrics.forward_backward(req.model_id, out.metrics, len(req.data), tokens)
            return Done(body=encode_output(out.outputs, out.metrics))

        return future(request, work, req.model_id, req.seq_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(body: _OptimStep, request: Request):
        tenant = _tenant(request, body.model_id)
        if isinstance(tenant, JSONResponse):
            return tenant
        if body.adam_params is None:
            return error(400, f"optim_step: only adam_params are served (got {body.optimizer_params!r})")
        step = AdamStep(**body.adam_params.model_dump())

        async def work() -> Done:
            metrics = await tenant.call(service, "optim_step", step)
            steps = int(metrics["step:max"])
            service.metrics.optim_step(body.model_id, steps, metrics, step.learning_rate)
            return Done({"metrics": metrics})

        return future(request, work, body.model_id, body.seq_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(body: _SaveForSampler, request: Request):
        who = owner(request)
        tenant = _tenant(request, body.model_id)
        if isinstance(tenant, JSONResponse):
            return tenant
        if body.kind != "snapshot":
            return error(400, f"save_weights_for_sampler: kind {body.kind!r} is not served; snapshot only")
        path = cfg.base_model(tenant.base_model).path
        if body.path is not None:  # a named sampler checkpoint: the adapter bundle, on disk
            try:
                where = CheckpointPath(
                    body.model_id, "sampler_weights", checkpoint_name(body.path, "save_weights_for_sampler")
                )
                service.checkpoints.require()
            except UserError as e:
                return error(400, str(e))

            def named():
                return save_named_sampler(service, tenant, body.model_id, who, where)

            return future(request, named, body.model_id, body.seq_id)

        def work():
            return tenant.run(
                service,
                lambda actor: service.samplers.save_for_sampler(
                    actor, tenant.base_model, path, who, tenant.session_id
                ),
            )

        return future(request, work, body.model_id, body.seq_id)

    add_routes(app, service, owner, future, _session, _tenant)

    @app.post("/api/v1/asample")
    async def asample(body: SampleBody, request: Request):
        try:
            session = service.samplers.session(body.sampling_session_id, owner(request))
        except UserError as e:
            return error(404, str(e))
        try:
            call = sample_call(body, session)
        except UserError as e:
            return error(400, str(e))
        return future(request, lambda: service.samplers.sample(session, call), samples=body.num_samples)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: _Retrieve, request: Request):
        if service.book.owner(body.request_id) != owner(request):
            return error(404, f"unknown request_id {body.request_id!r}")
        outcome = await service.book.result(body.request_id)
        if outcome is None:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if isinstance(outcome, Failed):
            return {"error": outcome.error, "category": outcome.category}
        if outcome.body is not None:
            return Response(outcome.body, media_type=PROTOBUF)
        return outcome.value

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def refused(path: str, request: Request):
        return error(404, f"{request.method} /{path} is not served by cluster.serve; served: {SERVED}")

    return app
