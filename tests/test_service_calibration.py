"""Calibration through the service, end to end: a real ``fusekit serve`` with real workers
(the fixtures of test_service.py); BatchNorm MLP clients fused, each client computing its
statistics of the fused model on its own share of the embedded digits, the service
calibrating; refusals of bad statistics; the admin finishing early; kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from bench_service import ServiceProcess, http
from test_service import (  # noqa: F401
    ADMIN,
    admin,
    cli,
    files_in,
    one_line_error,
    service,
    sha256,
    wait_for_progress,
    workers,
)

import fusekit
from conftest import mlp, write
from fusekit.client import Client, ServiceError
from fusekit.core.model_spec import fused_spec
from fusekit.core.stats import InputMoments, Moments, Statistics, save_statistics
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.data import load_dataset

NAMES = ("hospital-a", "hospital-b", "hospital-c")
WIDTHS = (64, 24, 16, 10)  # a BatchNorm MLP on the digits' 8x8 pixels


@pytest.fixture(scope="module")
def digits() -> list[np.ndarray]:
    """Each client's own inputs: a third of the digits' training images, flattened."""
    x = load_dataset("digits").x_train
    return np.array_split(x.reshape(len(x), -1), len(NAMES))


@pytest.fixture(scope="module")
def bn_models(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("bn-clients")
    return [write(folder / f"{name}.safetensors", mlp(WIDTHS, batchnorm=True, seed=i),
                  num_samples=400 + i) for i, name in enumerate(NAMES)]


def fused_job(admin, service, models, names=NAMES) -> dict:  # noqa: F811
    """A job that calibrates, its checkpoints submitted, waiting for statistics."""
    job = admin.create_job("pfnm", list(names), params={"sweeps": 2}, auto_run=True,
                           calibrate=True)
    for name, path in zip(names, models, strict=False):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job["id"], name, path)
    state = admin.wait(job["id"], timeout=120, every=0.1)
    assert state["state"] == "calibrating" and state["progress"] is None, state
    assert state["finished_at"] is None and state["fused"]["sha256"]
    return job


def statistics_file(fused: Path, inputs: np.ndarray, path: Path, **options) -> Path:
    """What a client runs: ``fusekit stats FUSED --mode batch`` on its own inputs."""
    return save_statistics(path, client_statistics(fused, inputs, **{"mode": "batch",
                                                                      **options}))


def put_statistics(service, job_id, client, token, body) -> httpx.Response:  # noqa: F811
    return http("PUT", f"{service.url}/v1/jobs/{job_id}/clients/{client}/statistics",
                       content=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def assert_same_tensors(path: Path, expected: dict) -> None:
    got = fusekit.load_checkpoint(path)
    assert sorted(got.tensors) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got.tensor(name), array, err_msg=name)


def test_three_clients_calibrate_as_fusekit_calibrate_does(service, admin, bn_models,  # noqa: F811
                                                           digits, tmp_path):
    job = fused_job(admin, service, bn_models)
    stats = []
    for name, inputs in zip(NAMES, digits, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            mine = client.status(job["id"])
            assert mine["calibrate"] and not mine["statistics"]["filled"]
            fused = client.fused(job["id"], tmp_path / f"fused-{name}.safetensors")
            assert sha256(fused) == mine["fused"]["sha256"]
            assert fusekit.load_checkpoint(fused).content_hash == mine["fused"]["model"]
            path = statistics_file(fused, inputs, tmp_path / f"{name}.stats.safetensors")
            slot = client.submit_statistics(job["id"], name, path)
            assert slot["filled"] and slot["sha256"] == sha256(path)
            assert client.submit_statistics(job["id"], name, path) == slot  # sent once
            stats.append(path)
    state = admin.wait(job["id"], timeout=120, every=0.1)
    assert state["state"] == "succeeded", state
    assert all(slot["filled"] for slot in state["statistics"].values())

    fused = admin.fused(job["id"], tmp_path / "fused.safetensors")
    uncalibrated = fusekit.fuse(bn_models, "pfnm", sweeps=2)
    assert_same_tensors(fused, uncalibrated.state_dict)
    calibrated = admin.result(job["id"], tmp_path / "calibrated.safetensors")
    expected = fusekit.calibrate(fused, stats)
    assert_same_tensors(calibrated, expected.state_dict)
    assert not np.array_equal(expected.state_dict["1.running_var"],
                              uncalibrated.state_dict["1.running_var"])
    report = admin.report(job["id"])
    assert report["widths"] == uncalibrated.widths
    assert report["calibration"] == {**expected.report["calibration"], "protocol": "one pass",
                                     "statistics_from": list(NAMES), "missing": [],
                                     "targets_from": [], "targets_missing": list(NAMES)}
    assert report["calibration"]["samples"] == sum(len(x) for x in digits)
    with (Client(service.url, job["tokens"][NAMES[0]]) as client,
          pytest.raises(ServiceError, match=r"has succeeded; statistics file uploads are "
                                            r"accepted only while it is calibrating")):
        client.submit_statistics(job["id"], NAMES[0], stats[1])


def tampered(stats: Statistics, point: str, **fields) -> Statistics:
    moments = stats.points[point]
    changed = Moments(**{f: fields.get(f, getattr(moments, f)) for f in ("count", "mean",
                                                                         "var")})
    return Statistics(stats.model, stats.num_samples, stats.mode,
                      {**stats.points, point: changed})


def test_statistics_refused_with_one_line_and_the_admin_finishes_early(
        service, admin, bn_models, digits, tmp_path):  # noqa: F811
    names = NAMES[:2]
    job = fused_job(admin, service, bn_models[:2], names)
    job_id, token = job["id"], job["tokens"][names[0]]
    fused = admin.fused(job_id, tmp_path / "fused.safetensors")
    good = client_statistics(fused, digits[0], mode="batch")
    point = next(iter(good.points))

    def refused(stats_or_body, status, *words):
        body = stats_or_body
        if isinstance(stats_or_body, Statistics):
            path = save_statistics(tmp_path / "bad.stats.safetensors", stats_or_body,
                                   force=True)
            body = path.read_bytes()
        one_line_error(put_statistics(service, job_id, names[0], token, body), status, *words)

    bad_var = good.points[point].var.copy()
    bad_var[0] = -1.0
    refused(tampered(good, point, var=bad_var), 400, "statistics of client 'hospital-a'",
            "variances must be finite and >= 0")
    refused(tampered(good, point, count=np.zeros_like(good.points[point].count)), 400,
            "statistics of client 'hospital-a'", "positive counts")
    refused(tampered(good, point, mean=good.points[point].mean[:3],
                     var=good.points[point].var[:3], count=good.points[point].count[:3]),
            400, "statistics of client 'hospital-a'", "expected count, mean and var of shape")
    refused(client_statistics(bn_models[0], digits[0], mode="batch"), 400,
            "statistics of client 'hospital-a'", "computed for model")  # its own model
    refused(client_statistics(fused, digits[0][:20], mode="batch", min_samples=1), 400,
            "statistics over 20 inputs; at least 32 are required")
    refused(client_statistics(fused, digits[0], mode="eval"), 400,
            "computed in eval mode", "--mode batch")
    refused(tampered(good, point, mean=good.points[point].mean * 1e150), 400,
            "statistics of client 'hospital-a'", f"point {point!r}: means up to",
            "expected at most 1e+12")  # finite, but the calibrated float32 model would not be
    refused(tampered(good, point, var=np.full_like(good.points[point].var, 1e308)), 400,
            "statistics of client 'hospital-a'", "variances up to 1e+308")
    refused(tampered(good, point, count=good.points[point].count * 2.0**900), 400,
            "statistics of client 'hospital-a'", "of at most 2**53")  # count x mean: inf
    refused(bn_models[0].read_bytes(), 413, "this job's limit for a statistics file")
    small = write(tmp_path / "small.safetensors", mlp((3, 2, 2)))
    refused(small.read_bytes(), 400, "statistics of client 'hospital-a'",
            "not a statistics file")
    good_path = save_statistics(tmp_path / "good.stats.safetensors", good)
    other = job["tokens"][names[1]]
    one_line_error(put_statistics(service, job_id, names[0], other, good_path.read_bytes()),
                   403, f"client '{names[1]}': its token cannot act for client '{names[0]}'")
    state = admin.status(job_id)
    assert not any(slot["filled"] for slot in state["statistics"].values())
    assert not files_in(service.data_dir / "jobs" / job_id / "statistics")

    with pytest.raises(ServiceError, match=r"no statistics yet from any of its 2 clients; "
                                           r"calibration needs at least one \(HTTP 409\)"):
        admin.calibrate(job_id)
    with (Client(service.url, other) as client,
          pytest.raises(ServiceError, match="needs the admin token")):
        client.calibrate(job_id)
    with Client(service.url, token) as client:
        client.submit_statistics(job_id, names[0], good_path)
    assert admin.calibrate(job_id)["state"] == "queued"
    state = admin.wait(job_id, timeout=120, every=0.1)
    assert state["state"] == "succeeded", state
    expected = fusekit.calibrate(fused, [good_path])
    assert_same_tensors(admin.result(job_id, tmp_path / "calibrated.safetensors"),
                        expected.state_dict)
    report = admin.report(job_id)["calibration"]
    assert report["statistics_from"] == [names[0]] and report["missing"] == [names[1]]
    assert report["clients"] == 1 and report["samples"] == len(digits[0])


def test_only_a_calibrating_job_takes_statistics(service, admin, bn_models, digits,  # noqa: F811
                                                 tmp_path):
    with pytest.raises(ServiceError, match=r"calibrate: method 'ams' keeps every client's "
                                           r"model .* \(HTTP 422\)"):
        admin.create_job("ams", ["a"], calibrate=True)
    plain = admin.create_job("avg", ["a"])
    stats = statistics_file(bn_models[0], digits[0], tmp_path / "s.safetensors")
    one_line_error(put_statistics(service, plain["id"], "a", plain["tokens"]["a"],
                                  stats.read_bytes()), 409, "was not created to calibrate")
    with (Client(service.url, plain["tokens"]["a"]) as client,
          pytest.raises(ServiceError, match="is collecting checkpoints; its fused model is "
                                            "there once it has succeeded")):
        client.fused(plain["id"], tmp_path / "f.safetensors")
    early = admin.create_job("avg", ["a"], calibrate=True)
    one_line_error(put_statistics(service, early["id"], "a", early["tokens"]["a"],
                                  stats.read_bytes()), 409, "is collecting", "calibrating")
    with (Client(service.url, early["tokens"]["a"]) as client,
          pytest.raises(ServiceError, match="is collecting checkpoints; the fused model is "
                                            "there once")):
        client.fused(early["id"], tmp_path / "f.safetensors")
    assert not (tmp_path / "f.safetensors").exists()


def test_cli_calibrating_job_end_to_end(service, bn_models, digits, tmp_path,  # noqa: F811
                                        monkeypatch):
    """The README's flow: job create --calibrate; each client submit, fetch, stats --mode
    batch, submit the statistics; job status, wait, result and fused."""
    monkeypatch.setenv("FUSEKIT_SERVER", service.url)
    monkeypatch.setenv("FUSEKIT_ADMIN_TOKEN", ADMIN)
    names = NAMES[:2]
    created = cli("job", "create", "--method", "avg", "--clients", ",".join(names),
                  "--calibrate", "--auto-run", "--json")
    assert created.exit_code == 0, created.output
    job = json.loads(created.stdout)
    for name, path in zip(names, bn_models, strict=False):
        monkeypatch.setenv("FUSEKIT_TOKEN", job["tokens"][name])
        assert cli("submit", service.url, path, "--job", job["id"], "--client", name
                   ).exit_code == 0
    waited = cli("job", "wait", job["id"], "--timeout", "120")
    assert waited.exit_code == 0 and "calibrating" in waited.stdout, waited.output
    none = cli("job", "calibrate", job["id"])
    assert none.exit_code == 2 and "no statistics yet" in none.output
    assert len(none.output.strip().splitlines()) == 1
    stats = []
    for name, inputs in zip(names, digits, strict=False):
        monkeypatch.setenv("FUSEKIT_TOKEN", job["tokens"][name])
        fused = tmp_path / f"{name}-fused.safetensors"
        fetched = cli("fetch", service.url, "--job", job["id"], "--client", name, "-o", fused)
        assert fetched.exit_code == 0, fetched.output
        data = tmp_path / f"{name}.npz"
        np.savez(data, x_train=inputs, y_train=np.zeros(len(inputs), np.int64),
                 x_test=inputs[:10], y_test=np.zeros(10, np.int64))
        stats.append(tmp_path / f"{name}.stats.safetensors")
        computed = cli("stats", fused, "--mode", "batch", "--data-path", data, "-o", stats[-1])
        assert computed.exit_code == 0, computed.output
        if name == names[0]:
            status = cli("job", "status", job["id"])
            assert "calibrating" in status.stdout and f"{name} statistics" in status.stdout
            assert "fused model" in status.stdout
        sent = cli("submit", service.url, stats[-1], "--job", job["id"], "--client", name)
        assert sent.exit_code == 0 and f"{name}: accepted statistics" in sent.stdout, sent.output
    waited = cli("job", "wait", job["id"], "--timeout", "120")
    assert waited.exit_code == 0 and "succeeded" in waited.stdout, waited.output
    out, before = tmp_path / "calibrated.safetensors", tmp_path / "fused.safetensors"
    assert cli("job", "result", job["id"], "-o", out).exit_code == 0
    assert cli("job", "fused", job["id"], "-o", before).exit_code == 0
    assert sha256(before) == sha256(tmp_path / f"{names[0]}-fused.safetensors")
    assert_same_tensors(out, fusekit.calibrate(before, stats).state_dict)


def send_partial_statistics(server, job_id, client, token, body) -> socket.socket:
    """Headers and half the body of a statistics upload, the socket kept open."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"PUT /v1/jobs/{job_id}/clients/{client}/statistics HTTP/1.1\r\n"
                 f"Host: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
    return sock


@pytest.mark.spread  # a server of its own
def test_kill9_during_and_after_statistics_uploads_and_of_the_calibrating_worker(
        bn_models, digits, tmp_path):
    """Nothing accepted is lost to kill -9 of the server; a worker killed while it
    calibrates (its calibration process starting or running) is replaced, and the job is
    calibrated again: one attempt more than the fusion's and the killed calibration's."""
    lease = ("--job-lease", "1")
    server = ServiceProcess(tmp_path / "data", options=("--min-stats-samples", "400", *lease),
                            env={"FUSEKIT_ADMIN_TOKEN": ADMIN})
    server.start()
    try:
        with Client(server.url, ADMIN) as admin:
            job = fused_job(admin, server, bn_models)
            job_id = job["id"]
            fused = admin.fused(job_id, tmp_path / "fused.safetensors")
            paths = [statistics_file(fused, x, tmp_path / f"{n}.stats.safetensors")
                     for n, x in zip(NAMES, digits, strict=True)]
            few = statistics_file(fused, digits[0][:300], tmp_path / "few.stats.safetensors")
            one_line_error(put_statistics(server, job_id, NAMES[0], job["tokens"][NAMES[0]],
                                          few.read_bytes()), 400,
                           "statistics over 300 inputs; at least 400 are required")
            with Client(server.url, job["tokens"][NAMES[0]]) as first:
                accepted = first.submit_statistics(job_id, NAMES[0], paths[0])
            partial = send_partial_statistics(server, job_id, NAMES[1],
                                              job["tokens"][NAMES[1]], paths[1].read_bytes())
            time.sleep(0.2)  # the partial upload is being received
            server.kill()
            partial.close()
            server.start()
            state = admin.status(job_id)
            assert state["state"] == "calibrating"
            assert state["statistics"][NAMES[0]] == accepted
            assert not state["statistics"][NAMES[1]]["filled"]
            folder = server.data_dir / "jobs" / job_id
            (stored,) = files_in(folder / "statistics")
            assert sha256(stored) == sha256(paths[0])
            deadline = time.monotonic() + 30  # the dead server's partial upload is swept
            while files_in(folder / "uploads") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not files_in(folder / "uploads")

            with Client(server.url, job["tokens"][NAMES[1]]) as second:
                second.submit_statistics(job_id, NAMES[1], paths[1])
            server.kill()  # right after an answered upload
            server.options = ("--min-stats-samples", "1000", *lease)  # the job keeps its 400
            server.start()
            state = admin.status(job_id)
            assert state["statistics"][NAMES[1]]["sha256"] == sha256(paths[1])
            assert state["min_stats_samples"] == 400 < len(digits[2])
            with Client(server.url, job["tokens"][NAMES[2]]) as third:
                third.submit_statistics(job_id, NAMES[2], paths[2])
            # The worker sets this progress, then spawns the calibration's process (an
            # interpreter importing fusekit: far longer than this loop's 10 ms polls).
            wait_for_progress(admin, job_id, "calibrating with the statistics of 3 of 3 "
                              "clients")
            (worker,) = workers(server.process.pid)
            os.kill(worker, signal.SIGKILL)
            state = admin.wait(job_id, timeout=120, every=0.1)
            assert state["state"] == "succeeded" and state["attempts"] == 3, state
            assert workers(server.process.pid) != [worker]
            assert_same_tensors(admin.result(job_id, tmp_path / "calibrated.safetensors"),
                                fusekit.calibrate(fused, paths).state_dict)
            assert not list(folder.glob(".*.tmp")) and not files_in(folder / "uploads")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def plain_models(tmp_path_factory) -> list[Path]:
    """MLPs without BatchNorm: calibration is REPAIR, towards the clients' targets."""
    folder = tmp_path_factory.mktemp("plain-clients")
    return [write(folder / f"plain-{i}.safetensors", mlp(WIDTHS, seed=10 + i),
                  num_samples=400 + i) for i in range(len(NAMES) + 1)]


def put_targets(service, job_id, client, token, body) -> httpx.Response:  # noqa: F811
    return http("PUT", f"{service.url}/v1/jobs/{job_id}/clients/{client}/targets",
                       content=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_plain_mlp_calibrated_with_targets_as_fusekit_calibrate_does(
        service, admin, plain_models, digits, tmp_path, monkeypatch):  # noqa: F811
    """Targets (each client's statistics of its own checkpoint) taken from the checkpoint's
    upload on, checked against that checkpoint, dropped when it is replaced; a job without
    BatchNorm waits for them and the admin cannot calibrate it with none; calibrated with
    those received, exactly as fusekit.calibrate is with the same files."""
    job = admin.create_job("pfnm", list(NAMES), params={"sweeps": 2}, calibrate=True)
    job_id, tokens = job["id"], job["tokens"]
    own = [client_statistics(m, x) for m, x in zip(plain_models, digits, strict=False)]
    targets = [save_statistics(tmp_path / f"{n}.targets.safetensors", s)
               for n, s in zip(NAMES, own, strict=True)]
    one_line_error(put_targets(service, job_id, NAMES[0], tokens[NAMES[0]],
                               targets[0].read_bytes()), 409, "no checkpoint yet")
    checkpoints = [plain_models[3], *plain_models[1:3]]
    for name, path in zip(NAMES, plain_models, strict=False):
        with Client(service.url, tokens[name]) as client:
            client.submit(job_id, name, path)
    with Client(service.url, tokens[NAMES[0]]) as client:
        assert client.submit_targets(job_id, NAMES[0], targets[0])["filled"]
        one_line_error(put_targets(service, job_id, NAMES[0], tokens[NAMES[0]],
                                   targets[1].read_bytes()), 400,
                       f"targets of client '{NAMES[0]}': computed for model",
                       "the checkpoint it submitted")
        client.submit(job_id, NAMES[0], checkpoints[0])  # replaced: its targets go with it
        assert not client.status(job_id)["targets"]["filled"]
    assert not files_in(service.data_dir / "jobs" / job_id / "targets")
    admin.run(job_id)
    state = admin.wait(job_id, timeout=120, every=0.1)
    assert state["state"] == "calibrating" and state["fused"]["needs_targets"], state
    fused = admin.fused(job_id, tmp_path / "fused.safetensors")
    stats = [statistics_file(fused, x, tmp_path / f"{n}.stats.safetensors")
             for n, x in zip(NAMES, digits, strict=True)]
    for name, path in zip(NAMES, stats, strict=True):
        with Client(service.url, tokens[name]) as client:
            assert client.submit_any_statistics(job_id, name, path)[0] == "statistics"
    state = admin.status(job_id)
    assert state["state"] == "calibrating"
    assert state["waiting_for"] == {"statistics": [], "targets": list(NAMES)}
    monkeypatch.setenv("FUSEKIT_SERVER", service.url)
    monkeypatch.setenv("FUSEKIT_ADMIN_TOKEN", ADMIN)
    status = cli("job", "status", job_id)
    assert status.exit_code == 0 and f"{NAMES[2]} targets" in status.stdout, status.output
    assert f"targets of {', '.join(NAMES)}" in " ".join(status.stdout.split()), status.stdout
    with pytest.raises(ServiceError, match=r"no targets yet from any of its clients; its "
                                           r"fused model has no BatchNorm .* \(HTTP 409\)"):
        admin.calibrate(job_id)

    own[0] = client_statistics(checkpoints[0], digits[0])
    targets[0] = save_statistics(targets[0], own[0], force=True)
    monkeypatch.setenv("FUSEKIT_TOKEN", tokens[NAMES[0]])
    sent = cli("submit", service.url, targets[0], "--job", job_id, "--client", NAMES[0])
    assert sent.exit_code == 0 and f"{NAMES[0]}: accepted targets" in sent.stdout, sent.output
    with Client(service.url, tokens[NAMES[1]]) as client:
        assert client.submit_any_statistics(job_id, NAMES[1], targets[1])[0] == "targets"
    assert admin.status(job_id)["waiting_for"]["targets"] == [NAMES[2]]
    assert admin.calibrate(job_id)["state"] == "queued"
    state = admin.wait(job_id, timeout=120, every=0.1)
    assert state["state"] == "succeeded", state
    expected = fusekit.calibrate(fused, stats, targets=targets[:2])
    calibrated = admin.result(job_id, tmp_path / "calibrated.safetensors")
    assert_same_tensors(calibrated, expected.state_dict)
    assert not np.array_equal(expected.state_dict["0.weight"],
                              fusekit.load_checkpoint(fused).tensor("0.weight"))
    report = admin.report(job_id)["calibration"]
    assert report["repair"] and report["targets_from"] == list(NAMES[:2])
    assert report["targets_missing"] == [NAMES[2]]
    one_line_error(put_targets(service, job_id, NAMES[2], tokens[NAMES[2]],
                               targets[2].read_bytes()), 409, "has succeeded")


def test_targets_checked_against_the_clients_model_within_its_size(
        service, admin, plain_models, digits, tmp_path):  # noqa: F811
    """Input moments of the first layer's dimension and name only, a file no larger than the
    client's model needs (refused from its header, before any check that grows with the
    file's d), moments that keep a calibrated model finite: each refused in one line naming
    the slot, nothing stored; the honest file is then taken."""
    job = admin.create_job("pfnm", list(NAMES[:1]), calibrate=True, protocol="layerwise",
                           input_moments=True)
    job_id, token = job["id"], job["tokens"][NAMES[0]]
    with Client(service.url, token) as client:
        client.submit(job_id, NAMES[0], plain_models[0])
    good = client_statistics(plain_models[0], digits[0], input_moments=True)
    ((point, moments),) = good.inputs.items()
    assert point == "input:0" and moments.mean.shape == (WIDTHS[0],)

    def with_inputs(inputs: dict, points=good.points) -> bytes:
        stats = Statistics(good.model, good.num_samples, good.mode, points, inputs=inputs)
        return save_statistics(tmp_path / "t.safetensors", stats, force=True).read_bytes()

    def moments_of(d: int) -> InputMoments:
        return InputMoments(float(len(digits[0])), np.zeros(d), np.eye(d))

    slot = f"targets of client '{NAMES[0]}'"
    for body, status, words in [
        (with_inputs({point: moments_of(60)}), 400,
         ["point 'input:0': input moments of shape (60,)", "vectors of 64"]),
        (with_inputs({"input:zzz": moments}), 400,
         ["point 'input:zzz': not an input point of the model", "'input:0'"]),
        (with_inputs({point: moments_of(200)}), 413, ["over", "this job's limit for a "
                                                      "targets"]),
        (with_inputs({point: InputMoments(moments.count, moments.mean * 1e150,
                                          moments.cov)}), 400, [slot, "mean up to"]),
        (with_inputs(good.inputs, tampered(good, "preactivation:0",
                                           mean=good.points["preactivation:0"].mean
                                           * 1e150).points), 400,
         [slot, "means up to"]),
    ]:
        one_line_error(put_targets(service, job_id, NAMES[0], token, body), status, *words)
    assert not files_in(service.data_dir / "jobs" / job_id / "targets")
    honest = save_statistics(tmp_path / "good.targets.safetensors", good)
    with Client(service.url, token) as client:
        assert client.submit_targets(job_id, NAMES[0], honest)["filled"]


def tiny_vit(folder: Path, seed: int) -> Path:
    """A tiny ViT model folder (config.json, model.safetensors), every weight random."""
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=24, num_labels=3)
    model = transformers.ViTForImageClassification(config).eval()
    model.save_pretrained(folder)
    return folder


def test_parameters_checked_at_creation_against_the_declared_clients_and_spec(
        service, tmp_path):  # noqa: F811
    """A transformer job given both its clients' config.json and a spec/3: model_type,
    widths and number of blocks must agree (422, one line, before any upload); agreeing,
    the job is created. A per-client list holds one value per client declared."""
    folder = tiny_vit(tmp_path / "vit", seed=0)
    config = json.loads((folder / "config.json").read_text())
    spec = fused_spec(fusekit.load_checkpoint(folder)).to_json()

    def create(config: dict) -> httpx.Response:
        return http("POST", f"{service.url}/v1/jobs", json={
            "method": "pfnm", "clients": ["a", "b"], "config": config, "spec": spec},
            headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)

    for change, words in [
        ({"model_type": "gpt2"}, ["config: model_type 'gpt2'; the spec given describes a "
                                  "'vit' model"]),
        ({"intermediate_size": 32}, ["config: 'intermediate_size' is 32; the spec's mlp group",
                                     "has size 24"]),
        ({"hidden_size": 8}, ["'hidden_size' is 8; the spec's stream group"]),
        ({"num_hidden_layers": 3}, ["'num_hidden_layers' is 3; the spec given has 2 MLP"]),
    ]:
        one_line_error(create({**config, **change}), 422, *words)
    assert create(config).status_code == 201
    refused = http("POST", f"{service.url}/v1/jobs", json={
        "method": "pfnm", "clients": ["a", "b"], "params": {"sigma": [1.0] * 50}},
        headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    one_line_error(refused, 422, "sigma: expected one value, or one per client (2), found 50")


def test_a_transformer_job_calibrates_with_its_clients_targets(
        service, admin, tmp_path):  # noqa: F811
    """Transformers fused from their weight files under the job's spec: each client sends
    its statistics of its own model (targets) and of the fused model (eval mode: no
    BatchNorm), run on its model folder; the service calibrates (REPAIR of the MLP units
    and LayerNorms) as fusekit.calibrate does with the same files."""
    from fusekit.core.model_spec import client_spec

    names = NAMES[:2]
    folders = [tiny_vit(tmp_path / name, seed=i) for i, name in enumerate(names)]
    spec = client_spec(fusekit.load_checkpoint(folders[0]), None).to_json()
    job = admin.create_job("ot", list(names), spec=spec, auto_run=True, calibrate=True)
    job_id, rng = job["id"], np.random.default_rng(0)
    inputs = [rng.normal(size=(40, 1, 8, 8)).astype(np.float32) for _ in names]
    targets = []
    for name, folder, x in zip(names, folders, inputs, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job_id, name, folder / "model.safetensors")
            targets.append(save_statistics(tmp_path / f"{name}.targets.safetensors",
                                           client_statistics(folder, x)))
            client.submit_targets(job_id, name, targets[-1])
    state = admin.wait(job_id, timeout=120, every=0.1)
    assert state["state"] == "calibrating", state
    assert state["fused"]["needs_targets"] and state["fused"]["mode"] == "eval"
    fused = admin.fused(job_id, tmp_path / "fused.safetensors")
    stats = []
    for name, folder, x in zip(names, folders, inputs, strict=True):
        runnable = tmp_path / f"fused-{name}"  # the fused weights with the client's config
        runnable.mkdir()
        shutil.copy(fused, runnable / "model.safetensors")
        shutil.copy(folder / "config.json", runnable / "config.json")
        stats.append(save_statistics(tmp_path / f"{name}.stats.safetensors",
                                     client_statistics(runnable, x)))
        with Client(service.url, job["tokens"][name]) as client:
            client.submit_statistics(job_id, name, stats[-1])
    state = admin.wait(job_id, timeout=120, every=0.1)
    assert state["state"] == "succeeded", state
    expected = fusekit.calibrate(fused, stats, targets=targets)
    assert_same_tensors(admin.result(job_id, tmp_path / "calibrated.safetensors"),
                        expected.state_dict)
    assert admin.report(job_id)["calibration"]["targets_from"] == list(names)
