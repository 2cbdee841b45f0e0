"""The HTTP API (FastAPI): jobs, uploads, results. No fusion here: jobs go to the workers.

Every refusal is JSON ``{"error": "<one line>"}`` naming the client, tensor or parameter,
with the status of :mod:`fusekit.service.errors` (422 for bad parameters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fusekit._version import __version__
from fusekit.api import validate_params
from fusekit.core.errors import FusekitError, ParameterError, SpecError, UnknownMethodError
from fusekit.core.metadata import load_json
from fusekit.core.spec import SPEC_FORMAT, check_spec_format
from fusekit.core.transformer import TRANSFORMER_FORMAT, check_config_matches_spec
from fusekit.methods import get_method
from fusekit.methods.params import TEXT_KINDS
from fusekit.service.auth import admin_token_hash, bearer, matches
from fusekit.service.errors import (
    Busy,
    Conflict,
    Forbidden,
    NotFound,
    ServiceError,
    TooLarge,
    bounded,
)
from fusekit.service.settings import Settings
from fusekit.service.states import job_in_state
from fusekit.service.store import (
    CHECKPOINT,
    STATISTICS,
    TARGETS,
    JobStore,
    SlotKind,
    authorize,
    check_accepting,
    make_private,
    view,
    without_paths,
)
from fusekit.service.rounds import PROTOCOLS, stale
from fusekit.service.uploads import (
    Checker,
    Upload,
    checkpoint_check,
    round_check,
    targets_bytes,
    targets_check,
)
from fusekit.service.web import add_web
from fusekit.service.worker import (
    CONFIG,
    FUSED,
    REPORT,
    RESULT,
    fusion_memory,
    in_units,
    make_queue,
    recover,
)

log = logging.getLogger(__name__)

# What a request may set: values, never a path on the server or a Python object (such as
# OT's activation provider, which would read data of the server's choosing).
REQUEST_KINDS = tuple(kind for kind in TEXT_KINDS if kind != "path")

RETRY_LATER = (429, 503)  # answered with Retry-After
MAX_REQUEST_BYTES = 1024 * 1024  # a job request: names of up to 1000 clients, parameters
REFUSAL_CHARS = 1000  # of a refusal's one line, whatever a value it quotes
HASH_PREFIX = re.compile(r"[0-9a-fA-F]{8,64}")

Auth = Annotated[str | None, Header(alias="Authorization", include_in_schema=False)]


class JobRequest(BaseModel):
    """POST /v1/jobs: a fusion of one checkpoint per client."""

    # strict: no lenient conversions ("1000" for an integer, "yes" for a flag), as the CLI
    model_config = ConfigDict(extra="forbid", strict=True)
    method: str = Field(description="a fusion method: avg, pfnm, nafi, ot, ams")
    params: dict[str, Any] = Field(
        default_factory=dict, description="the method's parameters, as fusekit.fuse takes them")
    clients: list[str] = Field(min_length=1, max_length=1000, description="one slot per client")
    max_checkpoint_bytes: int | None = Field(None, ge=1, description="upload size limit")
    auto_run: bool = Field(False, description="queue the job when the last slot is filled")
    spec: dict[str, Any] | None = Field(None, description="a permutation spec (JSON object)")
    calibrate: bool = Field(False, description="after fusion, calibrate the fused model with "
                            "statistics each client computes of it on its own data")
    protocol: Literal[PROTOCOLS] = Field(  # type: ignore[valid-type]
        "one-pass", description="the calibration's rounds: one-pass (one round), layerwise "
        "(one round per calibrated layer: exact), align (calibration, an alignment round, "
        "one refit round per layer)")
    input_moments: bool = Field(False, description="layerwise: the first layer from the input "
                                "moments the clients' targets carry, without a round")
    config: dict[str, Any] | None = Field(
        None, description="a transformer's config.json: the fused model and result are "
        "served with it, at the fused widths, as model folders")


def create_app(settings: Settings) -> FastAPI:
    make_private(settings.data_dir)
    store = JobStore(settings.data_dir)
    admin_hash, admin_file = admin_token_hash(settings.data_dir)
    huey, run_job_task = make_queue(settings)
    receiving_slots: set[tuple[str, str]] = set()  # (job, client) of uploads in progress

    checker = Checker(min(settings.max_uploads, os.cpu_count() or 1))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_recover_forever(settings, huey, run_job_task))
        yield
        task.cancel()
        checker.close()

    app = FastAPI(title="fusekit service", version=__version__, lifespan=lifespan,
                  description="Clients submit checkpoints; fusekit fuses them as a job.")
    app.state.admin_token_file = admin_file
    _add_error_handlers(app, settings.data_dir)

    def caller(authorization: str | None) -> tuple[str, bool]:
        token = bearer(authorization)
        return token, matches(token, admin_hash)

    def admin_only(authorization: str | None) -> None:
        if not caller(authorization)[1]:
            raise Forbidden("this request needs the admin token")

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        queued = await run_in_threadpool(huey.pending_count)  # the queue answers
        return {"status": "ok", "version": __version__, "queue": huey.storage.__class__.__name__,
                "queued": queued}

    @app.post("/v1/jobs", status_code=201, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {
            "schema": JobRequest.model_json_schema()}}}})
    async def create_job(request: Request, authorization: Auth = None) -> dict[str, Any]:
        admin_only(authorization)  # before reading a byte of the body
        body = await _job_request(request)
        _check_params(body.method, body.params, body.clients, body.spec)
        if body.calibrate and not get_method(body.method).makes_one_network:
            raise ParameterError(f"calibrate: method {body.method!r} keeps every client's model "
                                 "(its result is not a single network to calibrate); expected a "
                                 "method that fuses them into one")
        limit = body.max_checkpoint_bytes or settings.max_checkpoint_bytes
        if limit > settings.max_checkpoint_bytes:
            raise ParameterError(f"max_checkpoint_bytes: expected at most "
                                 f"{settings.max_checkpoint_bytes} (the server's limit), "
                                 f"found {limit}")
        _check_widths(body.params, len(body.clients), limit, settings.max_job_memory)
        _check_protocol(body)
        if body.spec is not None:
            check_spec_format(body.spec)
            if body.config is not None:  # both describe the clients' models: they must agree
                check_config_matches_spec(body.config, body.spec)
        job, tokens = await run_in_threadpool(
            store.create, method=body.method, params=body.params, spec=body.spec,
            clients=body.clients, max_checkpoint_bytes=limit, auto_run=body.auto_run,
            max_jobs=settings.max_jobs, calibrate=body.calibrate,
            min_stats_samples=settings.min_stats_samples, protocol=body.protocol,
            input_moments=body.input_moments, config=body.config)
        return {"id": job["id"], "tokens": tokens}

    async def receive(job_id: str, client: str, request: Request, authorization: str | None,
                      kind: SlotKind, for_round: int | None = None) -> dict[str, Any]:
        """Stream an upload of ``kind`` into the client's slot (module docstring of
        :mod:`fusekit.service.uploads`); returns the job as it is once accepted. Statistics
        are for the job's current round (``for_round``, when the client says which)."""
        token, admin = caller(authorization)
        job = store.read(job_id)
        authorize(job, token, admin, client)
        if client not in job["clients"]:
            raise NotFound(f"job {job_id}: no slot for client {client!r}")
        check_accepting(job, kind, client)
        current = job["round"]["index"] if kind is STATISTICS else None
        if for_round is not None and for_round != current:
            raise Conflict(stale(f"client {client!r}", for_round, job["round"]))
        limit, validate = _upload_rules(store, job, client, kind, settings)
        if kind is TARGETS:  # what the client's model needs, read in a checker process
            limit = await checker.run(targets_bytes, store.file(job, client, CHECKPOINT),
                                      job["spec"], limit)
        checkpoint = job["slots"][client]["sha256"] if kind is TARGETS else None
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"client {client!r}: Content-Length {declared} is over {limit} "
                           f"bytes, this job's limit for a {kind.name}")
        slot = (job_id, client, kind.name)
        if slot in receiving_slots:
            raise Busy(f"client {client!r}: an upload into this slot is in progress; one at a "
                       "time per slot", retry_after=5)
        if len(receiving_slots) >= settings.max_uploads:
            raise Busy(f"uploads: {settings.max_uploads} in progress, the server's limit; "
                       "retry later")
        receiving = Upload(store.upload_folder(job_id), client, limit, settings, validate,
                           kind.name)
        receiving_slots.add(slot)
        try:
            await receiving.receive(request.stream(), checker)
            job = await run_in_threadpool(
                store.accept, job_id, client, receiving.part, receiving.size,
                receiving.sha256.hexdigest(), kind, checkpoint, current)
        except ClientDisconnect:
            raise ServiceError(f"client {client!r}: the upload was interrupted; nothing "
                               "stored") from None
        except (FusekitError, OSError):
            store.read(job_id)  # the job deleted meanwhile (its files with it): 404
            raise
        finally:
            receiving_slots.discard(slot)
            receiving.discard()
        log.info("job %s: %s of %s accepted (%d bytes)", job_id, kind.name, client,
                 receiving.size)
        if job["state"] == "queued":  # this upload filled the last slot: the worker's turn
            await run_in_threadpool(run_job_task, job_id)
        return job

    @app.put("/v1/jobs/{job_id}/clients/{client}/checkpoint", status_code=201)
    async def upload(job_id: str, client: str, request: Request,
                     authorization: Auth = None) -> dict[str, Any]:
        job = await receive(job_id, client, request, authorization, CHECKPOINT)
        return view(job, client)["slot"]

    @app.put("/v1/jobs/{job_id}/clients/{client}/statistics", status_code=201)
    async def upload_statistics(job_id: str, client: str, request: Request,
                                authorization: Auth = None,
                                round: Annotated[int | None, Query(
                                    description="the round they were computed for: refused "
                                    "at once when it is over")] = None) -> dict[str, Any]:
        """A client's statistics for the job's current round (what the job's ``round``
        asks: statistics, cross or refit statistics of the round's model), while the job
        is calibrating; the last one queues the round's step."""
        job = await receive(job_id, client, request, authorization, STATISTICS, round)
        return view(job, client)["statistics"]

    @app.put("/v1/jobs/{job_id}/clients/{client}/targets", status_code=201)
    async def upload_targets(job_id: str, client: str, request: Request,
                             authorization: Auth = None) -> dict[str, Any]:
        """A client's statistics of its own checkpoint (``fusekit stats OWN``): REPAIR's
        targets for layers without BatchNorm, from its checkpoint's upload until the job's
        calibration starts."""
        job = await receive(job_id, client, request, authorization, TARGETS)
        return view(job, client)["targets"]

    @app.get("/v1/jobs/{job_id}/fused")
    async def fused(job_id: str, authorization: Auth = None) -> FileResponse:
        """The fused model, for the job's clients and the admin: a job that calibrates, its
        uncalibrated fused model from the end of its fusion (each client computes its
        statistics of it); any other job, its result once it has succeeded."""
        token, admin = caller(authorization)
        job = store.read(job_id)
        authorize(job, token, admin)
        if not job.get("calibrate"):
            if job["state"] != "succeeded":
                raise Conflict(f"{job_in_state(job_id, job['state'])}; its fused model is "
                               "there once it has succeeded")
            return FileResponse(store.root / job_id / RESULT,
                                media_type="application/octet-stream",
                                filename=f"fused-{job_id}.safetensors")
        if not job.get("fused") or job["state"] == "cancelled":
            raise Conflict(f"{job_in_state(job_id, job['state'])}; the fused model is there "
                           "once the fusion has finished (calibrating)")
        return FileResponse(store.root / job_id / FUSED, media_type="application/octet-stream",
                            filename=f"fused-{job_id}.safetensors")

    @app.get("/v1/jobs/{job_id}/model")
    async def round_model(job_id: str, authorization: Auth = None) -> FileResponse:
        """The model of the job's current calibration round (its fused model in the first
        round), for its clients (each computes its statistics of it) and the admin."""
        token, admin = caller(authorization)
        job = store.read(job_id)
        authorize(job, token, admin)
        if job["state"] != "calibrating":
            raise Conflict(f"{job_in_state(job_id, job['state'])}; a round's model is there "
                           "while the job is calibrating")
        index = job["round"]["index"]
        return FileResponse(store.root / job_id / job["round"]["file"],
                            media_type="application/octet-stream",
                            filename=f"round-{index}-{job_id}.safetensors",
                            headers={"X-Fusekit-Round": str(index)})

    @app.get("/v1/jobs/{job_id}/config")
    async def config(job_id: str, authorization: Auth = None) -> Response:
        """A transformer job's config.json at the fused widths, once fused: with the fused
        model, a round's model or the result, the model folder its clients can run."""
        token, admin = caller(authorization)
        job = store.read(job_id)
        authorize(job, token, admin)
        path = store.root / job_id / CONFIG
        if job.get("config") is None or not path.is_file():
            raise Conflict(f"job {job_id}: has no config.json" + (
                "" if job.get("config") is None else " yet; it is written once fused"))
        return Response(path.read_bytes(), media_type="application/json")

    @app.post("/v1/jobs/{job_id}/calibrate", status_code=202)
    async def calibrate(job_id: str, authorization: Auth = None) -> Response:
        """Calibrate now, with the statistics received so far (at least one client's)."""
        admin_only(authorization)
        job = await run_in_threadpool(store.finish_calibration, job_id)
        await run_in_threadpool(run_job_task, job_id)
        return JSONResponse(view(job), status_code=202,
                            headers={"Location": f"/v1/jobs/{job_id}"})

    @app.post("/v1/jobs/{job_id}/run", status_code=202)
    async def run(job_id: str, authorization: Auth = None) -> Response:
        admin_only(authorization)
        job = await run_in_threadpool(_queue, store, job_id, run_job_task)
        return JSONResponse(view(job), status_code=202,
                            headers={"Location": f"/v1/jobs/{job_id}"})

    @app.get("/v1/jobs/{job_id}")
    async def status(job_id: str, authorization: Auth = None) -> dict[str, Any]:
        token, admin = caller(authorization)
        job = store.read(job_id)
        return view(job, authorize(job, token, admin))

    @app.get("/v1/jobs/{job_id}/result")
    async def result(job_id: str, authorization: Auth = None) -> FileResponse:
        admin_only(authorization)
        folder = _finished(store, job_id)
        return FileResponse(folder / RESULT, media_type="application/octet-stream",
                            filename=f"fused-{job_id}.safetensors")

    @app.get("/v1/jobs/{job_id}/report")
    async def report(job_id: str, authorization: Auth = None) -> dict[str, Any]:
        """A succeeded job's report; a failed job's holds its whole error."""
        admin_only(authorization)
        job = store.read(job_id)
        path = store.root / job_id / REPORT
        if job["state"] == "failed" and path.is_file():
            return json.loads(path.read_text())
        return json.loads((_finished(store, job_id) / REPORT).read_text())

    @app.delete("/v1/jobs/{job_id}")
    async def delete(job_id: str, authorization: Auth = None) -> dict[str, Any]:
        admin_only(authorization)
        await run_in_threadpool(store.delete, job_id)
        return {"id": job_id, "deleted": True}

    add_web(app, store, admin_only, REQUEST_KINDS)
    return app


def _upload_rules(store: JobStore, job: dict[str, Any], client: str, kind: SlotKind,
                  settings: Settings) -> tuple[int, Any]:
    """The size limit of the client's upload of ``kind`` into the job, and its check."""
    if kind is CHECKPOINT:
        return job["max_checkpoint_bytes"], checkpoint_check(settings)
    if kind is TARGETS:
        if client not in job["slots"]:
            raise Conflict(f"client {client!r}: no checkpoint yet; targets are its statistics "
                           "of its own checkpoint, accepted once that is submitted")
        return job["max_checkpoint_bytes"], targets_check(
            store.file(job, client, CHECKPOINT), job["spec"], job["min_stats_samples"],
            job.get("input_moments", False))
    round_ = job["round"]
    earlier = {done["model"]: done["round"] for done in job.get("rounds_done", [])}
    own = store.file(job, client, CHECKPOINT)
    return (min(round_["max_bytes"], job["max_checkpoint_bytes"]),
            round_check(round_, own, job["spec"], job["min_stats_samples"], earlier))


def _check_protocol(body: JobRequest) -> None:
    """A protocol other than one pass, and input moments, belong to a job that
    calibrates; input moments save a layer-by-layer round."""
    if body.protocol != "one-pass" and not body.calibrate:
        raise ParameterError(f"protocol {body.protocol!r}: a calibration protocol; expected "
                             "it with calibrate: true")
    if body.input_moments and body.protocol != "layerwise":
        raise ParameterError(f"input_moments: they save the first round of the layerwise "
                             f"protocol; expected protocol 'layerwise', found {body.protocol!r}")
    transformer = _transformer_named(body)
    if body.protocol != "one-pass" and transformer:
        raise ParameterError(f"protocol: a transformer job ({transformer}) calibrates in one "
                             f"pass; expected protocol 'one-pass', found {body.protocol!r}")


def _transformer_named(body: JobRequest) -> str | None:
    """What in the request says the job fuses transformers (its config.json, a transformer
    spec), or None; a model known to be one only once fused is refused by the worker."""
    if body.config is not None:
        return "config given"
    if body.spec is not None and body.spec.get("format") == TRANSFORMER_FORMAT:
        return f"spec format {TRANSFORMER_FORMAT!r}"
    return None


async def _job_request(request: Request) -> JobRequest:
    """The body of POST /v1/jobs, read up to MAX_REQUEST_BYTES and parsed with bounded
    nesting (a framework's body parsing would read any size before the handler runs)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BYTES:
            raise TooLarge(f"request body: expected at most {MAX_REQUEST_BYTES} bytes of JSON, "
                           "found more")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParameterError(f"request body: expected UTF-8 JSON ({exc})") from None
    data = load_json(text, "request body", ParameterError)
    try:
        return JobRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _check_params(method: str, params: dict[str, Any], clients: list[str],
                  model_spec: dict[str, Any] | None) -> None:
    """As ``fusekit.fuse`` checks them, and only parameters a request can spell as values;
    a per-client list with one value per client the job declares, a per-layer list with
    one value per hidden layer of the sequential spec (``model_spec``) it gives."""
    _, declared = validate_params(method, params)
    layers = model_spec.get("layers") if isinstance(model_spec, dict) and model_spec.get(
        "format") == SPEC_FORMAT else None
    for spec in declared:
        value = params.get(spec.name)
        if spec.name in params and spec.kind not in REQUEST_KINDS:
            raise ParameterError(
                f"parameter {spec.name}: takes {spec.expected()}, which a service job cannot "
                "be given (no server-side paths or Python objects)")
        if spec.per_client and isinstance(value, list) and len(value) != len(clients):
            raise ParameterError(f"{spec.name}: expected one value, or one per client "
                                 f"({len(clients)}), found {len(value)} values")
        if (spec.kind == "ints" and isinstance(value, list) and isinstance(layers, list)
                and len(value) != len(layers) - 1):
            raise ParameterError(f"{spec.name}: expected one value, or one per hidden layer "
                                 f"({len(layers) - 1} in the spec given), found {len(value)} "
                                 "values")
    _check_anchor(params.get("anchor"), clients)


def _check_anchor(anchor: Any, clients: list[str]) -> None:
    """ot's and rebasin's anchor names one of the job's clients: its checkpoint as the
    worker names it (``<client>.safetensors``), or a prefix of its content hash (unknown
    until it is submitted)."""
    files = [f"{client}.safetensors" for client in clients]
    if not isinstance(anchor, str) or anchor in files or HASH_PREFIX.fullmatch(anchor):
        return
    shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
    raise ParameterError(f"anchor: expected the checkpoint of one of the job's clients "
                         f"({shown}) or a content-hash prefix of 8 to 64 hex digits, found "
                         f"{anchor[:80]!r}")


def _check_widths(params: dict[str, Any], clients: int, limit: int, memory: int) -> None:
    """Fused widths a job's clients could fill: a fused neuron holds at least two float32
    weights (8 bytes), so no layer is wider than the clients' files together could make
    (``width``); ``width_ratio`` (times the widest client) at most the number of clients,
    the width of every client's neurons side by side. Wider would only add inert neurons,
    and memory (cost matrices of every client's neurons by the fused width): no wider than
    the least that ``width`` takes fits in ``memory``."""
    widest = clients * limit // 8
    width = params.get("width")
    widths = width if isinstance(width, list) else [width]
    asked = max((w for w in widths if isinstance(w, int)), default=0)
    if asked > widest:
        raise ParameterError(f"width: expected at most {widest} per layer ({clients} "
                             f"client(s) of at most {limit} bytes, 8 bytes per fused neuron), "
                             f"found {asked}")
    per_neuron = fusion_memory([1], 1, 1, clients)  # models of one input and one output:
    # the least a fused neuron takes; the worker checks again with the clients' models
    if asked * per_neuron > memory:
        raise ParameterError(f"width: {asked} fused neurons need at least "
                             f"{in_units(asked * per_neuron)} ({per_neuron} bytes each with "
                             f"{clients} client(s)), over the {in_units(memory)} a job may "
                             f"use (fusekit serve --max-job-memory); expected at most "
                             f"{memory // per_neuron}")
    ratio = params.get("width_ratio")
    if ratio is not None and ratio > clients:
        raise ParameterError(f"width_ratio: expected at most {clients} (the number of "
                             f"clients: their neurons side by side), found {ratio:g}")


def _queue(store: JobStore, job_id: str, run_job_task: Any) -> dict[str, Any]:
    job = store.queue(job_id)
    run_job_task(job_id)  # lost in a crash right before this? recover() queues it again
    return job


def _finished(store: JobStore, job_id: str):
    job = store.read(job_id)
    if job["state"] != "succeeded":
        raise Conflict(f"{job_in_state(job_id, job['state'])}; a result exists once it "
                       "succeeded"
                       + (f" ({job['error']})" if job["error"] else ""))
    return store.root / job_id


async def _recover_forever(settings: Settings, huey, run_job_task) -> None:
    while True:
        try:
            await run_in_threadpool(recover, settings, huey, run_job_task)
        except Exception:  # keep serving; the next round retries
            log.exception("job recovery failed")
        await asyncio.sleep(settings.lease_s / 2)


def _add_error_handlers(app: FastAPI, data_dir: Path) -> None:
    @app.exception_handler(FusekitError)
    async def refused(request: Request, exc: FusekitError) -> JSONResponse:
        if isinstance(exc, ServiceError):
            status = exc.status
        elif isinstance(exc, ParameterError | SpecError | UnknownMethodError):
            status = 422
        else:
            status = 400
        headers = {}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if status in RETRY_LATER:  # clients wait at least this long before they try again
            headers["Retry-After"] = str(getattr(exc, "retry_after", 1))
        message = bounded(_one_line(without_paths(_in_json_words(exc), data_dir)),
                          REFUSAL_CHARS, "the rest left out")
        return JSONResponse({"error": message}, status_code=status,
                            headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code in RETRY_LATER:
            headers.setdefault("Retry-After", "1")
        return JSONResponse({"error": f"{request.url.path}: {exc.detail}"},
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": request_error(exc.errors()[0])}, status_code=422)


#: What a request's field should hold, by pydantic's error type, in the request's words
#: (JSON's), not pydantic's ("list should have at least 1 item after validation").
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a JSON list",
    "dict_type": "a JSON object",
    "greater_than_equal": "a number >= {ge}",
    "literal_error": "one of {expected}",
    "json_invalid": "a JSON body",
}


def request_error(error: dict[str, Any]) -> str:
    """One line for a request that does not fit its model: the field, what it expects and
    what it was given."""
    where = ".".join(str(part) for part in error["loc"] if part != "body") or "request"
    kind, context = error["type"], error.get("ctx") or {}
    if kind == "missing":
        return f"{where}: expected a value, found none"
    if kind == "extra_forbidden":
        return f"{where}: not a field of this request"
    if kind in ("too_short", "too_long"):
        limit = context.get("min_length", context.get("max_length"))
        bound = "at least" if kind == "too_short" else "at most"
        return (f"{where}: expected {bound} {limit} item{'s' * (limit != 1)}, found "
                f"{context.get('actual_length')}")
    if kind in _EXPECTED:
        found = json.dumps(error.get("input"), default=str)[:200]
        return f"{where}: expected {_EXPECTED[kind].format(**context)}, found {found}"
    return f"{where}: {error['msg'][:1].lower()}{error['msg'][1:]}"


def _in_json_words(error: FusekitError) -> str:
    """A parameter left out is null in a request, not Python's None."""
    return str(error).replace(", or None", ", or null") if error.keywords else str(error)


def _one_line(text: str) -> str:
    return " ".join(text.split())
