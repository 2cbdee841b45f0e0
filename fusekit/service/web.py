"""The service's web page (coordinator and client upload pages) and the JSON it needs
beyond the jobs API: the methods' parameter declarations and the list of jobs.

The pages are static files in ``static/`` (HTML, CSS, plain JavaScript): they talk to the
same JSON API as ``fusekit.client``, with the token the person types, and fetch nothing
from anywhere else (a Content-Security-Policy of 'self' holds them to it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Header
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from fusekit.core.errors import FusekitError
from fusekit.methods import METHODS
from fusekit.methods.params import method_params
from fusekit.service.store import JobStore

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "index.html", "/upload": "upload.html"}
# Scripts, styles, pictures and requests: this server only; no inline script, no framing.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

Auth = Annotated[str | None, Header(alias="Authorization", include_in_schema=False)]


def add_web(app: FastAPI, store: JobStore, admin_only: Callable[[str | None], None],
            request_kinds: tuple[str, ...]) -> None:
    """The pages, their static files, ``GET /v1/methods`` and ``GET /v1/jobs``."""
    declarations = methods_json(request_kinds)

    for path, name in PAGES.items():
        app.add_api_route(path, _page(name), methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/v1/methods")
    async def methods() -> dict[str, Any]:
        """The fusion methods and the parameters a job may set, as declared in
        ``fusekit.methods`` (the CLI's options and docs/PARAMETERS.md come from the same)."""
        return declarations

    @app.get("/v1/jobs")
    async def jobs(authorization: Auth = None) -> dict[str, Any]:
        """Every job, newest first: state, method, slots filled of total (checkpoints,
        statistics), times."""
        admin_only(authorization)
        return {"jobs": await run_in_threadpool(job_list, store)}


def _page(name: str) -> Callable[[], Any]:
    async def page() -> FileResponse:
        return FileResponse(STATIC / name, media_type="text/html", headers=HEADERS)
    return page


def methods_json(request_kinds: tuple[str, ...]) -> dict[str, Any]:
    return {"methods": [
        {"name": name, "summary": cls.summary,
         "params": [spec.to_json() for spec in method_params(cls)
                    if spec.kind in request_kinds]}
        for name, cls in sorted(METHODS.items())]}


def job_list(store: JobStore) -> list[dict[str, Any]]:
    listed = []
    for job_id in store.ids():
        try:
            job = store.read(job_id)
        except FusekitError:  # deleted meanwhile
            continue
        listed.append({
            **{k: job[k] for k in ("id", "method", "state", "progress", "created_at",
                                   "finished_at")},
            "clients": len(job["clients"]), "filled": len(job["slots"]),
            "statistics": len(job.get("statistics", {}))})
    return sorted(listed, key=lambda job: job["created_at"], reverse=True)
