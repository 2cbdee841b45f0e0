"""The fusion service, end to end: a real ``fusekit serve`` (uvicorn on 127.0.0.1, an
ephemeral port) with real worker processes, driven over HTTP by ``fusekit.client`` and raw
requests; every process is stopped by process group and every wait is bounded."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from bench_service import ServiceProcess, children, http, spawned
from bench_support import status_mb
from typer.testing import CliRunner

import fusekit
from conftest import mlp, write, write_raw
from fusekit._cli.app import app as cli_app
from fusekit.client import Client, ServiceError
from fusekit.service.auth import admin_token_hash, token_hash

ADMIN = secrets.token_urlsafe(32)
NAMES = ("hospital-a", "hospital-b", "hospital-c")
IDLE_S = 3  # seconds a test server lets an upload send nothing
MIN_RATE = 2000  # bytes/s a test server's uploads must average after their first IDLE_S
HANG_S = 120  # a bound on a hang: how long a test waits for what must come, at most
MAX_JOBS = 12  # jobs big_service keeps


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data = tmp_path_factory.mktemp("service") / "data"
    server = ServiceProcess(data, options=("--max-uploads", "2",
                                           "--max-checkpoint-bytes", str(2**20),
                                           "--upload-idle-timeout", str(IDLE_S),
                                           "--upload-min-rate", str(MIN_RATE),
                                           "--max-job-memory", str(2**24)),
                            env={"FUSEKIT_ADMIN_TOKEN": ADMIN})
    server.start()
    yield server
    server.stop()
    assert server.process.poll() is not None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clients")
    return [write(folder / f"{name}.safetensors", mlp((6, 5 + i, 3), seed=i),
                  num_samples=20 + i) for i, name in enumerate(NAMES)]


@pytest.fixture(scope="module")
def big_service(tmp_path_factory):
    """A server for large uploads whose value checks work in 1 MiB, and for held ones: an
    upload that sends nothing keeps its place for HANG_S, so that the uploads a test holds
    open stay held however busy the machine is; 2 upload places and MAX_JOBS jobs, so that
    its limits are reached in a few requests."""
    data = tmp_path_factory.mktemp("big-service") / "data"
    server = ServiceProcess(data, options=("--max-checkpoint-bytes", str(64 * 2**20),
                                           "--upload-check-bytes", str(2**20),
                                           "--max-uploads", "2", "--max-jobs", str(MAX_JOBS),
                                           "--upload-idle-timeout", str(HANG_S)),
                            env={"FUSEKIT_ADMIN_TOKEN": ADMIN})
    server.start()
    yield server
    server.stop()


@pytest.fixture
def admin(service):
    with Client(service.url, ADMIN) as client:
        yield client


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def put(service, job, client, token, body, **headers) -> httpx.Response:
    return http("PUT", f"{service.url}/v1/jobs/{job}/clients/{client}/checkpoint", content=body,
                       headers={"Authorization": f"Bearer {token}", **headers}, timeout=30)


def one_line_error(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert "\n" not in error
    for word in words:
        assert word in error, error
    return error


def test_three_clients_pfnm_equals_fusekit_fuse(service, admin, models, tmp_path):
    job = admin.create_job("pfnm", list(NAMES), params={"sigma": 1.0, "sweeps": 3})
    for name, path in zip(NAMES, models, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            seen: list[int] = []
            slot = client.submit(job["id"], name, path,
                                 progress=lambda sent, total, seen=seen: seen.append(sent))
            assert slot == {**slot, "filled": True, "sha256": sha256(path)}
            assert seen[-1] == path.stat().st_size
            mine = client.status(job["id"])  # a client sees its own slot, nothing of others
            assert mine["slot"]["filled"] and "slots" not in mine and "params" not in mine
            assert not any(other in json.dumps(mine) for other in NAMES if other != name)
    response = http("POST", f"{service.url}/v1/jobs/{job['id']}/run",
                            headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 202
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}"
    state = admin.wait(job["id"], timeout=60, every=0.1)
    assert state["state"] == "succeeded", state
    assert state["started_at"] <= state["finished_at"]

    fused = admin.result(job["id"], tmp_path / "fused.safetensors")
    expected = fusekit.fuse(models, "pfnm", sigma=1.0, sweeps=3)
    got = fusekit.load_checkpoint(fused)
    assert sorted(got.tensors) == sorted(expected.state_dict)
    for name, array in expected.state_dict.items():
        np.testing.assert_array_equal(got.tensor(name), array)
    module = mlp((6, *expected.widths, 3))
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                            got.state_dict().items()}, strict=True)
    report = admin.report(job["id"])
    assert report["widths"] == expected.widths and report["method"] == "pfnm"
    assert set(report) == {"output", "method", "params", "widths", "time_s", "report"}
    assert got.metadata["fusekit.method"] == "pfnm"  # the usual provenance


def test_resubmitting_sends_nothing_twice_and_a_new_file_replaces_the_old(service, admin,
                                                                          models):
    job = admin.create_job("avg", ["a"])
    clients = service.data_dir / "jobs" / job["id"] / "clients"
    with Client(service.url, job["tokens"]["a"]) as client:
        first = client.submit(job["id"], "a", models[0])
        again = client.submit(job["id"], "a", models[0])
        assert again["uploaded_at"] == first["uploaded_at"]  # not uploaded a second time
        replaced = client.submit(job["id"], "a", models[1])
        assert replaced["sha256"] == sha256(models[1])
        assert [p.name for p in clients.iterdir()] == [f"a.{sha256(models[1])}.safetensors"]
        admin.run(job["id"])
        with pytest.raises(ServiceError, match=r"uploads are accepted only while it is "
                                               r"collecting \(HTTP 409\)"):
            client.submit(job["id"], "a", models[2])
    assert admin.wait(job["id"], timeout=60, every=0.1)["state"] == "succeeded"


def assert_slot_matches_its_file(data_dir: Path, job_id: str, client: str) -> dict:
    """The slot's record names the one file of the client on disk, with its SHA-256."""
    job = json.loads((data_dir / "jobs" / job_id / "job.json").read_text())
    slot = job["slots"][client]
    stored = sorted((data_dir / "jobs" / job_id / "clients").glob(f"{client}.*"))
    assert [p.name for p in stored] == [slot["file"]]
    assert sha256(stored[0]) == slot["sha256"]
    return slot


def test_concurrent_accepts_into_one_slot_keep_the_last_file(tmp_path, models):
    """Many threads accept three files in turn into one slot (several API servers may):
    the slot holds the last accepted file, its record matches it, nothing else is left."""
    from fusekit.service.store import JobStore

    store = JobStore(tmp_path)
    job, _ = store.create(method="avg", params={}, spec=None, clients=["a"],
                          max_checkpoint_bytes=2**20, auto_run=False, max_jobs=10)
    bodies = [(p.read_bytes(), sha256(p)) for p in models]

    def accept(i: int) -> dict:
        body, digest = bodies[i % 3]
        part = store.upload_folder(job["id"]) / f"a.{i}.part"
        part.write_bytes(body)
        return store.accept(job["id"], "a", part, len(body), digest)["slots"]["a"]

    for _ in range(20):
        with ThreadPoolExecutor(15) as pool:
            accepted = list(pool.map(accept, range(15)))
        last = max(accepted, key=lambda slot: slot["uploaded_at"])
        assert assert_slot_matches_its_file(tmp_path, job["id"], "a") == last


def test_attempts_count_per_step_and_a_job_out_of_them_names_its_step(tmp_path):
    """A worker's death is counted against the step it was in (the fusion, a round): a
    new round starts with none; the third death in one step fails the job naming it."""
    from fusekit.service.settings import Settings
    from fusekit.service.store import JobStore
    from fusekit.service.worker import _requeue

    store = JobStore(tmp_path)
    job, _ = store.create(method="pfnm", params={}, spec=None, clients=["a"],
                          max_checkpoint_bytes=2**20, auto_run=False, max_jobs=10,
                          calibrate=True)
    round_ = {"kind": "statistics", "layers": ["3"], "mode": "eval", "index": 2, "total": 3,
              "participants": ["a"]}
    queued: list[str] = []
    settings = Settings(data_dir=tmp_path, lease_s=1.0, max_attempts=3)
    for attempt in range(1, 7):
        with store.locked(job["id"]) as record:
            record["state"] = "queued"
        assert store.claim(job["id"])["step_attempts"] == (attempt - 1) % 3 + 1
        if attempt == 3:  # the fusion's third run: done, the job enters a round
            store.conclude(job["id"], attempt, state="calibrating", round={
                **round_, "index": 1}, fused={"model": "m"}, statistics={})
            assert store.read(job["id"])["step_attempts"] == 0
            continue
        os.utime(store.root / job["id"] / "heartbeat", (0, 0))  # its worker silent since
        _requeue(store, settings, job["id"], None, queued.append)
    state = store.read(job["id"])
    assert state["state"] == "failed" and state["attempts"] == 6, state
    assert state["error"] == ("round 1 of 3: statistics of the round's model (eval mode, layer "
                              "'3'): the worker stopped 3 times while computing it (killed or "
                              "out of memory); not trying again")
    assert queued == [job["id"]] * 4


def test_concurrent_uploads_to_one_slot_keep_the_last_accepted_file(service, admin, models):
    job = admin.create_job("avg", ["a"])
    bodies = [p.read_bytes() for p in models]
    token = job["tokens"]["a"]

    def upload(i: int) -> int:
        for _ in range(200):  # bounded: a busy slot answers 429
            response = put(service, job["id"], "a", token, bodies[i % 3])
            if response.status_code != 429:
                return response.status_code
            time.sleep(0.01)
        return 429

    for _ in range(3):
        with ThreadPoolExecutor(15) as pool:
            assert set(pool.map(upload, range(15))) == {201}
        slot = assert_slot_matches_its_file(service.data_dir, job["id"], "a")
        assert admin.status(job["id"])["slots"]["a"]["sha256"] == slot["sha256"]
    admin.run(job["id"])
    state = admin.wait(job["id"], timeout=60, every=0.1)
    assert state["state"] == "succeeded", state


def test_no_job_error_names_a_server_path(tmp_path):
    from fusekit.service.store import without_paths

    data = tmp_path / "data"
    message = (f"internal error: FileNotFoundError: [Errno 2] No such file or directory: "
               f"'{data}/jobs/0123/clients/a.5e1f.safetensors'; {data}/jobs/0123/run/b.st: bad")
    assert without_paths(message, data) == (
        "internal error: FileNotFoundError: [Errno 2] No such file or directory: "
        "'a.5e1f.safetensors'; b.st: bad")


def test_auto_run_and_incompatible_checkpoints_fail_with_the_cli_message(service, admin,
                                                                         tmp_path,
                                                                         monkeypatch):
    a = write(tmp_path / "a.safetensors", mlp((6, 5, 3), seed=0))
    b = write(tmp_path / "b.safetensors", mlp((6, 5, 4, 3), seed=1))  # another architecture
    with pytest.raises(fusekit.core.errors.FusekitError) as expected:
        fusekit.fuse([a, b], "avg")
    job = admin.create_job("avg", ["a", "b"], auto_run=True)
    for name, path in (("a", a), ("b", b)):
        admin.submit(job["id"], name, path)
    state = admin.wait(job["id"], timeout=60, every=0.1)
    assert state["state"] == "failed"
    assert state["error"] == str(expected.value).replace(f"{tmp_path}{os.sep}", "")
    assert all(name in state["error"] for name in ["a.safetensors", "b.safetensors"]), \
        state["error"]
    monkeypatch.setenv("FUSEKIT_ADMIN_TOKEN", ADMIN)
    waited = cli("job", "wait", job["id"], "--server", service.url)
    assert waited.exit_code == 1
    assert waited.stdout.strip() == f"job {job['id']} has failed: {state['error']}"
    with pytest.raises(ServiceError,
                       match=r"has failed; a result exists once it succeeded.*\(HTTP 409\)"):
        admin.result(job["id"], tmp_path / "none.safetensors")


def test_a_width_beyond_the_memory_with_the_clients_models_fails_before_fusing(
        service, admin, models):
    """200,000 fused neurons pass the creation check (models of one input and output would
    take 9.6 MB of the server's 16 MiB); with the clients' 6 inputs and 3 outputs they
    need more, and the job fails before its fusion starts, the estimate in one line."""
    job = admin.create_job("pfnm", list(NAMES), params={"width": 200_000}, auto_run=True)
    for name, path in zip(NAMES, models, strict=True):
        admin.submit(job["id"], name, path)
    state = admin.wait(job["id"], timeout=60, every=0.1)
    assert state["state"] == "failed", state
    assert state["error"] == ("width: fused widths [200000] need at least 19.8 MiB with these "
                              "3 clients' models ('0' reads 6 values), over the 16.0 MiB a "
                              "job may use (fusekit serve --max-job-memory)")


def test_a_long_job_error_is_bounded_and_whole_in_the_report(service, admin, models):
    """A spec naming a tensor of 50,000 characters (its form is right: only the models
    tell it is wrong): the job's error, in every status and on the page, a few hundred
    characters; the whole text in the job's report. A refusal quoting a long value is
    bounded too."""
    name = "w" * 50_000
    spec = {"format": "fusekit.spec/1", "layers": [{"weight": name, "bias": "0.bias"},
                                                   {"weight": "2.weight", "bias": "2.bias"}]}
    job = admin.create_job("avg", list(NAMES), spec=spec, auto_run=True)
    for client, path in zip(NAMES, models, strict=True):
        admin.submit(job["id"], client, path)
    state = admin.wait(job["id"], timeout=60, every=0.1)
    assert state["state"] == "failed" and len(state["error"]) < 400, state["error"]
    assert state["error"].endswith("characters; the whole error is in the job's report)")
    whole = admin.report(job["id"])["error"]
    assert name in whole and whole.startswith(state["error"][:300])
    refused = http("POST", f"{service.url}/v1/jobs", json={
        "method": "pfnm", "clients": ["a"], "params": {name: 1}},  # an unknown parameter
        headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    error = one_line_error(refused, 422, "characters; the rest left out)")
    assert len(error) < 1100


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"method": "nope", "clients": ["a"]}, 422, ["unknown fusion method 'nope'"]),
    ({"method": "pfnm", "clients": ["a"], "params": {"sigmaa": 1}}, 422, ["sigmaa"]),
    ({"method": "ot", "clients": ["a"], "params": {"data_dir": "/etc"}}, 422, ["data_dir"]),
    ({"method": "ot", "clients": ["a"], "params": {"activations": None}}, 422,
     ["activations", "server-side paths"]),
    ({"method": "pfnm", "clients": ["a"], "params": {"sweeps": 2.5}}, 422,
     ["sweeps", "integer", "2.5"]),
    ({"method": "pfnm", "clients": ["a"], "params": {"sweeps": 10**9}}, 422, ["sweeps"]),
    ({"method": "pfnm", "clients": ["a"], "params": {"width": [10**9]}}, 422,
     ["width", "at most 131072", str(10**9)]),
    ({"method": "nafi", "clients": ["a", "b"], "params": {"width": 10**6}}, 422,
     ["width", "at most 262144"]),
    ({"method": "pfnm", "clients": ["a", "b", "c"], "params": {"width": [5, 360_000]}}, 422,
     ["width: 360000 fused neurons need at least 16.5 MiB (48 bytes each with 3 client(s)), "
      "over the 16.0 MiB a job may use (fusekit serve --max-job-memory); expected at most "
      "349525"]),
    ({"method": "ot", "clients": ["a", "b"], "params": {"anchor": "z" * 50_000}}, 422,
     ["anchor: expected the checkpoint of one of the job's clients (a.safetensors, "
      "b.safetensors) or a content-hash prefix of 8 to 64 hex digits, found 'zzz"]),
    ({"method": "pfnm", "clients": ["a", "b"], "params": {"width": [5] * 50},
      "spec": {"format": "fusekit.spec/1", "layers": [{"weight": "0.weight"},
                                                      {"weight": "2.weight"}]}}, 422,
     ["width: expected one value, or one per hidden layer (1 in the spec given), found 50"]),
    ({"method": "rebasin", "clients": ["a", "b"], "params": {"anchor": "a"}}, 422,
     ["anchor: expected the checkpoint", "found 'a'"]),
    ({"method": "pfnm", "clients": ["a", "b"], "params": {"width_ratio": 1e6}}, 422,
     ["width_ratio", "at most 2", "1e+06"]),
    ({"method": "pfnm", "clients": ["a"], "params": {"sweeps": "10"}}, 422, ["sweeps", "'10'"]),
    ({"method": "avg", "clients": ["a"], "params": {"class_weighted": "yes"}}, 422,
     ["class_weighted", "'yes'"]),
    ({"method": "avg", "clients": ["a"], "auto_run": "yes"}, 422, ["auto_run", "yes"]),
    ({"method": "avg", "clients": ["a"], "max_checkpoint_bytes": "1000"}, 422,
     ["max_checkpoint_bytes", "1000"]),
    ({"method": "avg", "clients": ["a"], "spec": {"x": 1}}, 422, ["spec", "format", "['x']"]),
    ({"method": "avg", "clients": ["a"], "spec": {"format": "fusekit.spec/1",
                                                  "layers": [{"weight": 3}]}}, 422,
     ["spec: layers[0].weight", "found 3"]),
    ({"method": "avg", "clients": ["../etc"]}, 400, ["client name '../etc'"]),
    ({"method": "avg", "clients": ["a\nb"]}, 400, ["client name 'a\\nb'"]),
    ({"method": "avg", "clients": ["a", "a"]}, 400, ["distinct"]),
    ({"method": "avg", "clients": []}, 422, ["clients: expected at least 1 item, found 0"]),
    ({"method": "avg", "clients": ["a"], "max_checkpoint_bytes": 2**21}, 422,
     ["max_checkpoint_bytes", str(2**20)]),
    ({"method": "avg", "clients": ["a"], "extra": 1}, 422, ["extra: not a field of this request"]),
    ({"method": "avg", "clients": "a"}, 422, ["clients: expected a JSON list, found \"a\""]),
    ({"method": "pfnm", "clients": ["a"], "params": {"gamma": 0}}, 422,
     ["gamma: expected a finite number > 0, or null, found 0"]),
    ('{"method": "avg", "clients": ["a"], "spec": ' + "[" * 10000 + "]" * 10000 + "}", 422,
     ["request body", "nested"]),
    ("{not json", 422, ["request body", "not JSON"]),
    (b"\xff\xfe", 422, ["request body", "UTF-8"]),
    ('{"method": "avg", "clients": ["' + "a" * 2**20 + '"]}', 413, ["request body", "1048576"]),
])
def test_job_creation_refuses_bad_requests(service, body, status, words):
    response = http("POST", f"{service.url}/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"},
                            **({"json": body} if isinstance(body, dict) else {"content": body}))
    one_line_error(response, status, *words)


def test_tokens(service, admin, models):
    job = admin.create_job("avg", ["a", "b"])
    tokens = job["tokens"]
    assert len({*tokens.values(), ADMIN}) == 3 and all(len(t) >= 43 for t in tokens.values())
    body = models[0].read_bytes()
    url = f"{service.url}/v1/jobs/{job['id']}"
    one_line_error(http("GET", url), 401, "Bearer")
    one_line_error(http("GET", url, headers={"Authorization": "Basic abc"}), 401, "Bearer")
    one_line_error(put(service, job["id"], "b", tokens["a"], body), 403, "'a'", "'b'")
    one_line_error(put(service, job["id"], "a", "forged", body), 403, "token")
    one_line_error(http("POST", f"{service.url}/v1/jobs", json={"method": "avg", "clients": ["x"]},
                                headers={"Authorization": f"Bearer {tokens['a']}"}), 403, "admin")
    one_line_error(http("GET", f"{url}/result", headers={"Authorization": f"Bearer {tokens['a']}"}),
                   403, "admin")
    one_line_error(put(service, "0" * 32, "a", ADMIN, body), 404, "no such job")
    one_line_error(put(service, "../../etc", "a", ADMIN, body), 404)
    one_line_error(put(service, job["id"], "zz", ADMIN, body), 404, "'zz'")
    assert not admin.status(job["id"])["slots"]["b"]["filled"]
    shown = json.dumps(admin.status(job["id"]))
    assert not any(token in shown for token in tokens.values())
    on_disk = (service.data_dir / "jobs" / job["id"] / "job.json").read_text()
    assert not any(token in on_disk for token in tokens.values())  # only their hashes
    assert all(token_hash(token) in on_disk for token in tokens.values())
    log = service.log.read_text()
    assert not any(token in log for token in [*tokens.values(), ADMIN])


@pytest.mark.parametrize("form", [
    "Bearer\t{token}", "{token}", "bearer{token}", "Bearer:{token}", "Token {token}",
    "Basic {token}", "Bearer\t {token}", "{token} Bearer",
])
def test_a_malformed_authorization_header_never_echoes_the_token(service, admin, form):
    """No answer (body or headers) and no log line holds the token or a part of it."""
    job = admin.create_job("avg", ["a"])
    token = job["tokens"]["a"]
    for method, path in (("GET", ""), ("PUT", "/clients/a/checkpoint"), ("DELETE", "")):
        response = http(method, f"{service.url}/v1/jobs/{job['id']}{path}",
                        headers={"Authorization": form.format(token=token)},
                        content=b"x" if method == "PUT" else None)
        one_line_error(response, 401, "Bearer")
        assert_no_part_of(token, response.text + str(response.headers))
    assert_no_part_of(token, service.log.read_text())


def assert_no_part_of(secret: str, text: str, part: int = 8) -> None:
    pieces = {secret[i:i + part] for i in range(len(secret) - part + 1)}
    assert not any(piece in text for piece in pieces), text


def header(tensors: dict, metadata: dict | None = None) -> bytes:
    if metadata:
        tensors = {"__metadata__": metadata, **tensors}
    text = json.dumps(tensors).encode()
    return struct.pack("<Q", len(text)) + text


GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(("body", "status", "words"), [
    (header(GOOD) + b"\0" * 4, 400, ["truncated upload", "of the"]),
    (header(GOOD)[:20], 400, ["truncated"]),
    (b"\x01\x02", 400, ["truncated"]),
    (header(GOOD) + b"\0" * 12, 400, ["runs past"]),
    (struct.pack("<Q", 12) + b"{not json}!!" + b"\0" * 8, 400, ["header"]),
    (header({"w": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}) + b"\0" * 8, 400,
     ["'w'", "I32"]),
    (header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}) + b"\0" * 4, 400,
     ["'w'", "data_offsets", "[0, 8]"]),
    (header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}) + b"\0" * 16, 400,
     ["'w'", "data_offsets"]),
    (header({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}) + b"\0" * 8, 400,
     ["'w'", "X9"]),
    (header(GOOD, {"fusekit.num_samples": "-3"}) + b"\0" * 8, 400, ["fusekit.num_samples"]),
    (struct.pack("<Q", 2**62) + b"{}", 400, ["header claims", "expected at most"]),
    (struct.pack("<Q", 2**21) + b"{}", 413, ["header alone"]),
    (header({"w": {"dtype": "F32", "shape": [2**20], "data_offsets": [0, 2**22]}}), 413,
     ["declares a file of"]),
    (b"\x80\x04\x95" + b"\0" * 64, 400, ["pickle"]),
    (header(GOOD) + struct.pack("<2f", 1.0, float("nan")), 400, ["'w'", "1 non-finite"]),
    (header(GOOD) + struct.pack("<2f", float("inf"), float("-inf")), 400,
     ["'w'", "2 non-finite"]),
    (header({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})
     + np.array([1, np.inf], np.float16).tobytes(), 400, ["'w'", "1 non-finite"]),
    (header({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})
     + np.array([0x3F80, 0x7FC0], np.uint16).tobytes(), 400, ["'w'", "1 non-finite"]),
    (header({"bn.running_var": GOOD["w"]}) + struct.pack("<2f", 1.0, -2.0), 400,
     ["'bn.running_var'", "negative", "-2"]),
])
def test_uploads_refused_early_with_nothing_stored(service, admin, body, status, words):
    job = admin.create_job("avg", ["a"])
    one_line_error(put(service, job["id"], "a", job["tokens"]["a"], body), status,
                   "client 'a'", *words)
    assert_nothing_stored(service, admin, job["id"])


def test_a_safetensors_file_starting_as_a_pickle_does_is_accepted(service, admin):
    text = json.dumps(GOOD).encode().ljust(128)  # header length 128: first byte 0x80
    body = struct.pack("<Q", len(text)) + text + struct.pack("<2f", 1.0, 2.0)
    assert body[:1] == b"\x80"
    job = admin.create_job("avg", ["a"])
    answer = put(service, job["id"], "a", job["tokens"]["a"], body)
    assert answer.status_code == 201, answer.text
    assert admin.status(job["id"])["slots"]["a"]["filled"]


def assert_nothing_stored(service, admin, job_id):
    assert not admin.status(job_id)["slots"]["a"]["filled"]
    folder = service.data_dir / "jobs" / job_id
    deadline = time.monotonic() + 10
    while files_in(folder / "uploads") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not files_in(folder / "uploads")
    assert not files_in(folder / "clients")


def files_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_torch_pt_file_is_refused_unread(service, admin, tmp_path):
    torch.save(mlp().state_dict(), tmp_path / "model.pt")
    job = admin.create_job("avg", ["a"])
    one_line_error(put(service, job["id"], "a", job["tokens"]["a"],
                       (tmp_path / "model.pt").read_bytes()), 400, "pickle or torch .pt")
    assert_nothing_stored(service, admin, job["id"])


def test_body_size_is_enforced_while_streaming(service, admin, models):
    job = admin.create_job("avg", ["a"], max_checkpoint_bytes=300)
    body = models[0].read_bytes()
    assert len(body) > 300
    one_line_error(put(service, job["id"], "a", job["tokens"]["a"], body), 413,
                   "Content-Length")
    # No Content-Length (chunked): counted as it streams.
    chunks = iter([body[i:i + 64] for i in range(0, len(body), 64)])
    one_line_error(put(service, job["id"], "a", job["tokens"]["a"], chunks), 413, "300")
    assert_nothing_stored(service, admin, job["id"])


def test_client_disconnect_mid_upload_stores_nothing(service, admin, models):
    job = admin.create_job("avg", ["a"])
    send_partial(service, job["id"], "a", job["tokens"]["a"], models[0].read_bytes())
    assert_nothing_stored(service, admin, job["id"])


def test_a_stalled_upload_is_abandoned_and_stores_nothing(service, admin, models):
    job = admin.create_job("avg", ["a"])
    sock = send_partial(service, job["id"], "a", job["tokens"]["a"], models[0].read_bytes(),
                        keep_open=True)
    with sock:
        answer = read_answer(sock, IDLE_S + 20)  # the server answers once the upload has idled
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert f"client 'a': no data for {IDLE_S} s".encode() in answer
    assert_nothing_stored(service, admin, job["id"])


def test_a_trickling_upload_is_abandoned_and_frees_its_place(service, admin, models):
    """One byte every 0.2 s: refused once it falls behind the minimum rate (after the first
    IDLE_S seconds), though it is never idle that long."""
    job = admin.create_job("avg", ["a"])
    body = models[0].read_bytes()
    sock = send_partial(service, job["id"], "a", job["tokens"]["a"], body, keep_open=True,
                        part=8)
    answer, deadline = b"", time.monotonic() + IDLE_S + 20
    with sock:
        sock.settimeout(0.2)
        for byte in body[8:]:
            if time.monotonic() > deadline:
                break
            with contextlib.suppress(OSError):
                sock.sendall(bytes([byte]))
            with contextlib.suppress(TimeoutError):
                answer += sock.recv(65536)
            if answer.endswith(b"}"):
                break
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert f"slower than {MIN_RATE} bytes/s after the first {IDLE_S} s".encode() in answer
    assert_nothing_stored(service, admin, job["id"])


def test_one_upload_at_a_time_per_slot(big_service, models):
    """A second upload into a slot while one is received is refused (429, Retry-After),
    and takes no place from other clients."""
    with Client(big_service.url, ADMIN) as admin:
        job = admin.create_job("avg", ["a", "b"])
    body = models[0].read_bytes()
    with held_uploads(big_service, job, ["a"], body):
        response = put_until_refused(big_service, job, "a", body)
        one_line_error(response, 429, "client 'a'", "one at a time per slot")
        assert response.headers["Retry-After"] == "5"
        assert put(big_service, job["id"], "b", job["tokens"]["b"], body).status_code == 201


@contextlib.contextmanager
def held_uploads(service, job, clients, body) -> Iterator[list[socket.socket]]:
    """Uploads of half ``body`` into the slots of ``clients``, held open until the block
    ends (big_service keeps an idle upload for HANG_S), then hung up."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(send_partial(service, job["id"], client,
                                                job["tokens"][client], body, keep_open=True))
               for client in clients]


def put_until_refused(service, job, client, body) -> httpx.Response:
    """PUT ``body`` into ``client``'s slot until the server answers 429, which it does once
    the uploads a test holds open have reached it (at most HANG_S); that answer."""
    deadline = time.monotonic() + HANG_S
    while (response := put(service, job["id"], client, job["tokens"][client], body)
           ).status_code != 429:
        assert time.monotonic() < deadline, "the held uploads never reached the server"
        time.sleep(0.05)
    return response


def read_answer(sock, seconds: float) -> bytes:
    """The server's answer: chunks until its JSON body closes, it hangs up, or time is up."""
    answer, deadline = b"", time.monotonic() + seconds
    while not answer.endswith(b"}") and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def send_partial(service, job_id, client, token, body, keep_open=False, part=None):
    """Send headers and half the body of an upload, then hang up (or keep the socket)."""
    sock = socket.create_connection(("127.0.0.1", service.port), timeout=10)
    sock.sendall(f"PUT /v1/jobs/{job_id}/clients/{client}/checkpoint HTTP/1.1\r\n"
                 f"Host: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode()
                 + body[: len(body) // 2 if part is None else part])
    if keep_open:
        return sock
    time.sleep(0.2)
    sock.close()
    return None


def test_a_job_deleted_during_an_upload_answers_404(big_service, models):
    body = models[0].read_bytes()
    with Client(big_service.url, ADMIN) as admin:
        job = admin.create_job("avg", ["a"])
        with held_uploads(big_service, job, ["a"], body) as (sock,):
            deadline = time.monotonic() + HANG_S
            while not files_in(big_service.data_dir / "jobs" / job["id"] / "uploads"):
                assert time.monotonic() < deadline, "the upload never started"
                time.sleep(0.05)
            admin.delete(job["id"])
            sock.sendall(body[len(body) // 2:])
            answer = read_answer(sock, HANG_S).decode()  # headers and body may come apart
    assert answer.startswith("HTTP/1.1 404"), answer
    assert f"job '{job['id']}': no such job" in answer, answer


def test_upload_and_job_limits_answer_429(big_service, models):
    with Client(big_service.url, ADMIN) as admin:
        job = admin.create_job("avg", ["a", "b", "c"])
        body = models[0].read_bytes()
        with held_uploads(big_service, job, ["a", "b"], body):
            response = put_until_refused(big_service, job, "c", body)
            one_line_error(response, 429, "uploads", "2")
            assert response.headers["Retry-After"] == "1"
        created = []
        for _ in range(MAX_JOBS):  # the server keeps at most MAX_JOBS jobs
            response = http("POST", f"{big_service.url}/v1/jobs",
                                    json={"method": "avg", "clients": ["a"]},
                                    headers={"Authorization": f"Bearer {ADMIN}"})
            if response.status_code != 201:
                break
            created.append(response.json()["id"])
        one_line_error(response, 429, str(MAX_JOBS))
        assert response.headers["Retry-After"] == "30"
        for job_id in created:
            admin.delete(job_id)
    one_line_error(http("GET", f"{big_service.url}/v1/jobs/{created[0]}",
                               headers={"Authorization": f"Bearer {ADMIN}"}), 404)
    assert not (big_service.data_dir / "jobs" / created[0]).exists()
    assert not any((big_service.data_dir / "trash").iterdir())


def test_forty_concurrent_submits_all_succeed_through_busy_answers(service, admin, models):
    """The server takes 2 uploads at once; 40 clients submitting together each wait out
    the 429s (Retry-After, backoff with jitter) and every slot is filled."""
    names = [f"c{i}" for i in range(40)]
    job = admin.create_job("avg", names)
    lines: list[str] = []

    def submit(name: str) -> dict:
        with Client(service.url, job["tokens"][name], on_retry=lines.append) as client:
            return client.submit(job["id"], name, models[0])

    with ThreadPoolExecutor(40) as pool:
        slots = list(pool.map(submit, names))
    assert all(slot["sha256"] == sha256(models[0]) for slot in slots)
    assert all(s["filled"] for s in admin.status(job["id"])["slots"].values())
    assert lines, "no submit was ever refused as busy: the test did not test"
    assert all("the service is busy (HTTP 429); trying again in" in line for line in lines)
    admin.delete(job["id"])


def test_backoff_grows_with_jitter_and_honours_retry_after():
    from fusekit.client import MAX_BACKOFF_S, backoff

    for attempt in range(8):
        waits = [backoff(attempt, None) for _ in range(200)]
        top = min(2.0**attempt, MAX_BACKOFF_S)
        assert all(top / 2 <= w <= top for w in waits) and len(set(waits)) > 100
        assert all(backoff(attempt, 40.0) >= 40.0 for _ in range(10))


def test_cli_submit_waits_while_the_service_is_busy(big_service, models, monkeypatch):
    """With both upload places held, ``fusekit submit`` is refused, says that it waits, and
    goes through once the places are free."""
    with Client(big_service.url, ADMIN) as admin:
        job = admin.create_job("avg", ["a", "b", "c"])
    monkeypatch.setenv("FUSEKIT_TOKEN", job["tokens"]["a"])
    refused = threading.Event()
    tell = Client._tell

    def told(self, line: str) -> None:  # the submit's client says it waits, then waits
        tell(self, line)
        refused.set()

    monkeypatch.setattr(Client, "_tell", told)
    with ThreadPoolExecutor(1) as pool:
        with held_uploads(big_service, job, ["b", "c"], models[0].read_bytes()):
            put_until_refused(big_service, job, "a", models[0].read_bytes())  # places held
            submitted = pool.submit(cli, "submit", big_service.url, models[1], "--job",
                                    job["id"], "--client", "a")
            refused_while_held = refused.wait(HANG_S)
        result = submitted.result(timeout=HANG_S)  # the places are free again
    assert refused_while_held, "the submit was never refused while both places were held"
    assert result.exit_code == 0, result.output
    assert "client a: submit: the service is busy (HTTP 429); trying again in" in result.stderr
    assert result.stderr.count("submit: the service is busy") == result.stderr.count(
        "client a: submit: the service is busy"), result.stderr  # each wait said once
    with Client(big_service.url, ADMIN) as admin:
        assert admin.status(job["id"])["slots"]["a"]["sha256"] == sha256(models[1])


def test_a_large_tensor_is_checked_within_the_memory_budget(big_service, tmp_path):
    """A 48 MB tensor: its values are checked in 1 MiB pieces in a checker process, so
    neither that process nor the API server grows by anything near its size; a NaN in its
    last piece is found, and refused naming the tensor."""
    weights = np.ones(12 * 2**20, np.float32)
    good = write_raw(tmp_path / "good.safetensors", {"w": weights})
    weights[-1] = np.nan
    bad = write_raw(tmp_path / "bad.safetensors", {"w": weights})
    with Client(big_service.url, ADMIN) as admin:
        job = admin.create_job("avg", ["a"])
        admin.submit(job["id"], "a", good)  # the first check of a process sets it up
        job = admin.create_job("avg", ["a"])
        processes = [big_service.process.pid, *spawned(big_service.process.pid)]
        assert len(processes) > 1, "no checker process"
        before = {pid: status_mb("VmRSS", pid) for pid in processes}
        for pid in processes:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # peaks from now on
        one_line_error(put(big_service, job["id"], "a", ADMIN, bad.read_bytes()), 400,
                       "client 'a'", "tensor 'w' has 1 non-finite value")
        assert admin.submit(job["id"], "a", good)["sha256"] == sha256(good)
        grown = {pid: status_mb("VmHWM", pid) - before[pid] for pid in processes}
    assert max(grown.values()) < 16, grown  # MB, against a 48 MB tensor read twice


def test_healthz_answers_while_a_large_header_is_checked(big_service, tmp_path):
    """50,000 tensors (a 3.5 MB header) take seconds to check; the server keeps answering."""
    path = write_raw(tmp_path / "many.safetensors",
                     {f"t{i}": np.ones(1, np.float32) for i in range(50_000)})
    with Client(big_service.url, ADMIN) as admin, ThreadPoolExecutor(1) as pool:
        job = admin.create_job("avg", ["a"])
        upload = pool.submit(put, big_service, job["id"], "a", ADMIN, path.read_bytes())
        answered_meanwhile = 0
        for _ in range(2000):  # bounded: 2000 answers
            assert http("GET", f"{big_service.url}/healthz", timeout=30).status_code == 200
            if upload.done():
                break
            answered_meanwhile += 1
        assert upload.result(timeout=120).status_code == 201
    assert answered_meanwhile > 0


def test_healthz_and_openapi(service):
    assert http("GET", f"{service.url}/healthz").json()["status"] == "ok"
    paths = http("GET", f"{service.url}/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/run", "/v1/jobs/{job_id}/result",
            "/v1/jobs/{job_id}/report", "/v1/jobs/{job_id}/clients/{client}/checkpoint",
            "/healthz"} <= set(paths)
    schema = paths["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"method", "params", "clients", "max_checkpoint_bytes"} <= set(schema["properties"])


def test_admin_token_file_is_generated_once_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv("FUSEKIT_ADMIN_TOKEN", raising=False)
    first, path = admin_token_hash(tmp_path)
    assert path == tmp_path / "admin.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert admin_token_hash(tmp_path) == (first, path)
    assert len(path.read_text().strip()) >= 43  # 256 random bits


def test_kill9_during_uploads_and_during_a_job_then_restart(tmp_path):
    """A crash loses nothing answered: uploads intact after kill -9, the killed job re-runs."""
    folder = tmp_path / "clients"
    folder.mkdir()
    paths = [write(folder / f"{n}.safetensors", mlp((64, 120, 300, 10), seed=i),
                   num_samples=10 + i) for i, n in enumerate(NAMES)]
    server = ServiceProcess(tmp_path / "data", options=("--job-lease", "1"))
    server.start()
    try:
        token_file = server.data_dir / "admin.token"
        assert f"admin token: {token_file}" in server.log.read_text()
        assert not spawned(server.process.pid)  # checkers start with the first upload
        admin = Client(server.url, token_file.read_text().strip())
        params = {"sweeps": 30}  # 0.7 s, nearly all of it the second layer
        job = admin.create_job("pfnm", list(NAMES), params=params)
        for name, path in zip(NAMES[:2], paths[:2], strict=True):
            admin.submit(job["id"], name, path)
        assert spawned(server.process.pid)
        partial = send_partial(server, job["id"], NAMES[2], job["tokens"][NAMES[2]],
                               paths[2].read_bytes(), keep_open=True)
        server.kill()
        partial.close()
        # The third client submits while the server is down: its client retries until the
        # restarted server answers.
        with (Client(server.url, job["tokens"][NAMES[2]], retries=6) as late,
              ThreadPoolExecutor(1) as pool):
            resumed = pool.submit(late.submit, job["id"], NAMES[2], paths[2])
            server.start()
            assert resumed.result(timeout=90)["sha256"] == sha256(paths[2])
        slots = admin.status(job["id"])["slots"]
        for name, path in zip(NAMES, paths, strict=True):
            assert slots[name]["sha256"] == sha256(path)
            stored = next((server.data_dir / "jobs" / job["id"] / "clients").glob(f"{name}.*"))
            assert sha256(stored) == sha256(path)

        admin.run(job["id"])
        with fusion_held_at(server, admin, job["id"], "fusing: layer 1 of 2 matched"):
            server.kill()  # between the job's two hidden layers
        server.start()
        state = admin.wait(job["id"], timeout=120, every=0.2)
        assert state["state"] == "succeeded", state
        assert state["attempts"] == 2
        fused = admin.result(job["id"], tmp_path / "fused.safetensors")
        expected = fusekit.fuse(paths, "pfnm", **params)
        got = fusekit.load_checkpoint(fused)
        for name, array in expected.state_dict.items():
            np.testing.assert_array_equal(got.tensor(name), array)
        folder = server.data_dir / "jobs" / job["id"]
        assert not list(folder.glob(".*.tmp")) and not files_in(folder / "uploads")
        assert sorted(p.name for p in folder.iterdir()) == [
            "clients", "heartbeat", "job.json", "lock", "report.json", "result.safetensors",
            "statistics", "targets", "uploads"]

        # kill -9 of the worker alone: the server starts another, which runs the job again.
        again = admin.create_job("pfnm", list(NAMES), params=params, auto_run=True)
        for name, path in zip(NAMES, paths, strict=True):
            admin.submit(again["id"], name, path)
        with fusion_held_at(server, admin, again["id"], "fusing: layer 1 of 2 matched"):
            (worker,) = workers(server.process.pid)
            os.kill(worker, signal.SIGKILL)
        state = admin.wait(again["id"], timeout=120, every=0.2)
        assert state["state"] == "succeeded" and state["attempts"] == 2, state
        assert workers(server.process.pid) != [worker]
        admin.close()
    finally:
        server.stop()


def test_deleting_a_running_job_stops_its_fusion(service, admin, tmp_path):
    """The fusion runs in a process of the worker's, killed when the job is deleted (a
    fusion of a minute or more here); the worker then runs the next job."""
    paths = [write(tmp_path / f"{n}.safetensors", mlp((64, 200, 200, 10), seed=i),
                   num_samples=10 + i) for i, n in enumerate(NAMES)]
    job = admin.create_job("pfnm", list(NAMES), params={"sweeps": 1000}, auto_run=True)
    for name, path in zip(NAMES, paths, strict=True):
        admin.submit(job["id"], name, path)
    wait_for_progress(admin, job["id"], "fusing", prefix=True)
    (worker,) = workers(service.process.pid)
    deadline = time.monotonic() + 60
    while not (fusions := forked(worker)):  # the job's fusion process, starting
        assert time.monotonic() < deadline, "no fusion process"
        time.sleep(0.05)
    assert len(fusions) == 1 and admin.status(job["id"])["state"] == "running"
    admin.delete(job["id"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{fusions[0]}").exists() and b"Z" not in proc_state(fusions[0]):
        assert time.monotonic() < deadline, "the deleted job's fusion still runs"
        time.sleep(0.1)
    small = admin.create_job("avg", ["a"], auto_run=True)
    admin.submit(small["id"], "a", paths[0])
    assert admin.wait(small["id"], timeout=120, every=0.1)["state"] == "succeeded"


def proc_state(pid: int) -> bytes:
    """The state letter of a process (Z: exited, not yet reaped), b"" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return b""


def cli(*args):
    return CliRunner().invoke(cli_app, [str(a) for a in args])


def test_cli_coordinator_and_clients_end_to_end(service, models, tmp_path, monkeypatch):
    """The service page's commands (docs/service.md): job create, submit (each client), job
    list/status/run/wait/result."""
    monkeypatch.setenv("FUSEKIT_SERVER", service.url)
    monkeypatch.setenv("FUSEKIT_ADMIN_TOKEN", ADMIN)
    created = cli("job", "create", "--method", "pfnm", "--clients", ",".join(NAMES),
                  "--param", "sigma=1.0", "--param", "sweeps=2", "--json")
    assert created.exit_code == 0, created.output
    job = json.loads(created.stdout)
    for name, path in zip(NAMES, models, strict=True):
        monkeypatch.setenv("FUSEKIT_TOKEN", job["tokens"][name])
        submitted = cli("submit", service.url, path, "--job", job["id"], "--client", name)
        assert submitted.exit_code == 0, submitted.output
        assert f"{name}: accepted {path.stat().st_size} bytes" in submitted.stdout
    status = cli("job", "status", job["id"])
    assert status.exit_code == 0 and "collecting" in status.stdout and "created" in status.stdout
    listed = cli("job", "list", "--json")
    assert listed.exit_code == 0, listed.output
    [mine] = [j for j in json.loads(listed.stdout) if j["id"] == job["id"]]
    assert (mine["state"], mine["method"], mine["filled"], mine["clients"]) == (
        "collecting", "pfnm", len(NAMES), len(NAMES))
    table = cli("job", "list")
    assert table.exit_code == 0 and job["id"] in table.stdout and "3 of 3" in table.stdout
    assert all(name in status.stdout for name in NAMES) and "waiting" not in status.stdout
    assert cli("job", "run", job["id"]).exit_code == 0
    waited = cli("job", "wait", job["id"], "--timeout", "60")
    assert waited.exit_code == 0 and "succeeded" in waited.stdout
    out = tmp_path / "fused.safetensors"
    assert cli("job", "result", job["id"], "-o", out).exit_code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    for name in NAMES:  # each client gets the fused model of a job without calibration
        with Client(service.url, job["tokens"][name]) as client:
            mine = client.fused(job["id"], tmp_path / f"{name}.safetensors")
        assert mine.read_bytes() == out.read_bytes()
    local = cli("fuse", *models, "--method", "pfnm", "-o", tmp_path / "local.safetensors")
    assert local.exit_code == 0, local.output
    assert stat.S_IMODE((tmp_path / "local.safetensors").stat().st_mode) == 0o600
    expected = fusekit.fuse(models, "pfnm", sigma=1.0, sweeps=2)
    for name, array in expected.state_dict.items():
        np.testing.assert_array_equal(fusekit.load_checkpoint(out).tensor(name), array)

    missing = cli("job", "result", "0" * 32, "-o", tmp_path / "none.safetensors")
    assert missing.exit_code == 2 and "no such job" in missing.output
    assert len(missing.output.strip().splitlines()) == 1
    assert not (tmp_path / "none.safetensors").exists()
    unreachable = cli("job", "status", job["id"], "--server", "http://127.0.0.1:9")
    assert unreachable.exit_code == 2 and "http://127.0.0.1:9: cannot reach" in unreachable.output
    monkeypatch.delenv("FUSEKIT_ADMIN_TOKEN")
    anonymous = cli("job", "status", job["id"])
    assert anonymous.exit_code == 2 and "admin token" in anonymous.output
    monkeypatch.setenv("FUSEKIT_TOKEN", "forged")
    forged = cli("submit", service.url, models[0], "--job", job["id"], "--client", NAMES[0])
    assert forged.exit_code == 2 and "token" in forged.output and "403" in forged.output


def test_the_data_folder_is_private_to_the_service(service, tmp_path):
    """Every folder 0700 and file 0600 after jobs ran (module's service), and a folder of
    an earlier version opened up (0755, 0644) made private at start."""
    assert_private(service.data_dir)
    data = tmp_path / "data"
    (data / "jobs" / "old").mkdir(parents=True)
    (data / "jobs" / "old" / "job.json").write_text("{}")
    for path, mode in ((data, 0o755), (data / "jobs" / "old", 0o755),
                       (data / "jobs" / "old" / "job.json", 0o644)):
        os.chmod(path, mode)
    server = ServiceProcess(data, options=("--workers", "0"))
    server.start()
    try:
        assert_private(data)
    finally:
        server.stop()


def assert_private(data: Path) -> None:
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [data, *data.rglob("*")]
             if not p.is_symlink()}
    assert len(modes) > 3
    wrong = {str(p): oct(m) for p, m in modes.items()
             if m != (0o700 if p.is_dir() else 0o600)}
    assert not wrong, wrong


def wait_for_progress(admin: Client, job_id: str, progress: str, timeout: float = 60,
                      prefix: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while not ((admin.status(job_id)["progress"] or "").startswith(progress) if prefix
               else admin.status(job_id)["progress"] == progress):
        assert time.monotonic() < deadline, admin.status(job_id)
        time.sleep(0.01)


#: How long :func:`fusion_held_at` lets a fusion run between two looks at its progress.
FUSION_STEP_S = 0.005


@contextlib.contextmanager
def fusion_held_at(server: ServiceProcess, admin: Client, job_id: str, progress: str,
                   timeout: float = 60) -> Iterator[None]:
    """Hold the job's fusion (SIGSTOP) at the first look that finds it at ``progress``, so
    that a kill in the block lands before the job ends however busy the machine is;
    SIGCONT to whatever is left of it after the block. Between two looks the fusion runs
    for ``FUSION_STEP_S`` and is stopped again before the next look, however long that
    look takes: left running while a busy machine listed processes and asked for the
    job's progress, a fusion went past the step watched for unseen."""
    deadline = time.monotonic() + timeout
    held: list[int] = []
    while True:
        with contextlib.suppress(OSError):  # a process listed a moment ago may be gone
            held = [fusion for worker in workers(server.process.pid)
                    for fusion in forked(worker)]
        send(held, signal.SIGSTOP)
        if held and admin.status(job_id)["progress"] == progress:
            break
        send(held, signal.SIGCONT)
        assert time.monotonic() < deadline, admin.status(job_id)
        time.sleep(FUSION_STEP_S)
        send(held, signal.SIGSTOP)
    try:
        yield
    finally:
        send(held, signal.SIGCONT)


def send(processes: list[int], signum: int) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signum)


def workers(pid: int) -> list[int]:
    """The worker processes among the children of a server."""
    return [child for child in children(pid) if b"fusekit.service.worker" in
            Path(f"/proc/{child}/cmdline").read_bytes()]


def forked(worker: int) -> list[int]:
    """A worker's fusion and calibration processes: the children of its fork server."""
    return [process for server in children(worker)
            if b"multiprocessing.forkserver" in Path(f"/proc/{server}/cmdline").read_bytes()
            for process in children(server)]
