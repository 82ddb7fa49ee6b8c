"""The named-checkpoint routes of the Tinker API (`cluster.serve.checkpoints` keeps the files, one
folder per API key): `save_weights` (`save_state`), `load_weights` (`load_state(_with_optimizer)` onto a
model, or `create_training_client_from_state(_with_optimizer)`: a new tenant with the checkpoint's base
model and rank), `create_sampling_session(model_path=tinker://.../sampler_weights/<name>)` and
`GET samplers/{id}`, `GET training_runs/{id}/checkpoints` (`RestClient.list_checkpoints`). A named `save_weights_for_sampler` is `save_named_sampler`. Every path is read in
the caller's own folder: another key's checkpoint "does not exist", the path named.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from cluster.serve.answers import error
from cluster.serve.checkpoints import CheckpointPath, checkpoint_name
from cluster.serve.futures import Done, UserError
from cluster.serve.recovery import SavedPoint
from cluster.serve.sampling import Probe


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _SaveWeights(_Body):
    model_id: str
    seq_id: int | None = None
    path: str | None = None
    overwrite: bool = False


class _LoadWeights(_Body):
    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    optimizer_config: dict[str, Any] | None = None


class _CreateSampling(_Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


async def save_named_sampler(service, tenant, model_id: str, owner: str, where: CheckpointPath) -> Done:
    """A named sampler checkpoint: the tenant's adapter bundle (as an engine applies it), on disk; the
    engine acknowledges it when a sampling session is made from it (`create_sampling_session`)."""
    bundle = await tenant.call(service, "adapter_bundle")
    path = service.config.base_model(tenant.base_model).path
    probe = await tenant.run(service, lambda actor: service.samplers.reference(actor, path))
    payload = {"base_model": tenant.base_model, "rank": tenant.rank, "bundle": bundle, "probe": probe.saved()}
    uri = await asyncio.to_thread(service.checkpoints.write, owner, where, payload, True)
    return Done({"path": uri, "type": "save_weights_for_sampler"})


async def load_checkpoint(service, req: _LoadWeights, owner: str) -> Done:
    """`load_state(_with_optimizer)` onto an existing model (model_id), or create-via-load (session_id
    + model_seq_id: a new tenant with the checkpoint's base model and rank, as
    `create_training_client_from_state(_with_optimizer)` sends)."""
    saved = await asyncio.to_thread(service.checkpoints.read, owner, req.path, "weights", "load_weights")
    if req.model_id is not None:
        tenant = service.tenant(req.model_id, owner)
        model_id = req.model_id
        if (tenant.base_model, tenant.rank) != (saved["base_model"], saved["rank"]):
            raise UserError(
                f"checkpoint {req.path!r} is a rank-{saved['rank']} adapter on {saved['base_model']!r}; "
                f"model {model_id!r} is rank {tenant.rank} on {tenant.base_model!r}"
            )
    else:
        session = service.sessions.get(req.session_id or "")
        if session is None or session.owner != owner or req.model_seq_id is None:
            raise UserError(f"load_weights: unknown session_id {req.session_id!r} (or no model_seq_id)")
        if req.base_model not in (None, saved["base_model"]):
            raise UserError(
                f"load_weights: base_model {req.base_model!r} is not the checkpoint's {saved['base_model']!r}"
            )
        if (req.optimizer_config or {}).get("type", "adamw") != "adamw":
            raise UserError(f"optimizer_config {req.optimizer_config!r}: only adamw is served")
        model_id = await service.start_tenant(
            owner, req.session_id, req.model_seq_id, saved["base_model"], saved["rank"], service.config.seed
        )
        tenant = service.tenants[model_id]
    await tenant.call(service, "load_training_state", saved["state"], req.optimizer)
    steps = int(saved["state"]["steps"])  # the tenant's state is the checkpoint's now: its recovery point
    tenant.saved = SavedPoint(req.path, steps, req.optimizer and saved["state"]["optimizer"] is not None)
    return Done({"path": req.path, "model_id": model_id, "type": "load_weights"})


def add_routes(app: FastAPI, service, owner, future, caller_session, caller_tenant) -> None:
    """The routes on `app`; owner/future/caller_session/caller_tenant are `build_app`'s helpers (the
    caller's key, a future's submission, a session or a tenant of the caller's or the error to answer)."""

    @app.post("/api/v1/save_weights")
    async def save_weights(body: _SaveWeights, request: Request):
        who = owner(request)
        tenant = caller_tenant(request, body.model_id)
        if isinstance(tenant, JSONResponse):
            return tenant
        try:
            where = CheckpointPath(body.model_id, "weights", checkpoint_name(body.path, "save_weights"))
            service.checkpoints.require()
        except UserError as e:
            return error(400, str(e))

        async def work() -> Done:
            generation = tenant.generation
            state = await tenant.call(service, "training_state")
            payload = {"base_model": tenant.base_model, "rank": tenant.rank, "state": state}
            uri = await asyncio.to_thread(service.checkpoints.write, who, where, payload, body.overwrite)
            if tenant.generation == generation:  # its actor did not die meanwhile: the recovery point
                tenant.saved = SavedPoint(uri, int(state["steps"]), state["optimizer"] is not None)
            return Done({"path": uri, "type": "save_weights"})

        return future(request, work, body.model_id, body.seq_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(body: _LoadWeights, request: Request):
        who = owner(request)
        if (body.model_id is None) == (body.session_id is None):
            return error(
                400, "load_weights: give model_id (+ seq_id) or session_id + model_seq_id, one of them"
            )
        return future(request, lambda: load_checkpoint(service, body, who), body.model_id, body.seq_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(body: _CreateSampling, request: Request):
        who = owner(request)
        s = caller_session(request, body.session_id)
        if isinstance(s, JSONResponse):
            return s
        if body.model_path is None:
            return error(
                400, "create_sampling_session: sampling the bare base model is not served; give model_path"
            )
        try:
            saved = await asyncio.to_thread(
                service.checkpoints.read, who, body.model_path, "sampler_weights", "create_sampling_session"
            )
        except UserError as e:
            return error(404, str(e))
        path = service.config.base_model(saved["base_model"]).path
        sid = await service.samplers.open_session(
            saved["bundle"], saved["base_model"], path, who, body.session_id, body.model_path,
            Probe.from_saved(saved.get("probe")),
        )  # fmt: skip
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/training_runs/{run}/checkpoints")
    async def list_checkpoints(run: str, request: Request):
        try:
            found = await asyncio.to_thread(service.checkpoints.listing, owner(request), run)
        except UserError as e:
            return error(400, str(e))
        return {"checkpoints": found, "cursor": None}

    @app.get("/api/v1/samplers/{sid}")
    async def get_sampler(sid: str, request: Request):
        try:
            s = service.samplers.session(sid, owner(request))
        except UserError as e:
            return error(404, str(e))
        return {"sampler_id": sid, "base_model": s.base_model, "model_path": s.model_path}
