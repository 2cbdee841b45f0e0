"""Calibration rounds through the service, end to end: a real ``fusekit serve`` with real
workers (the fixtures of test_service.py). A layer-by-layer job (the first layer from the
clients' input moments, no round) and an alignment + refit job on BatchNorm MLPs, each
client computing every round's file on its own share of the embedded digits with one call
(``Client.take_part`` / ``contribute``, ``fusekit contribute``); the result equal to what
fusekit.calibrate / align / refit give for the same files; a stale round's upload
refused in one line; the worker killed in every round of a layerwise and an align job; a
transformer job's fused model served with its config.json."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from bench_service import ServiceProcess, http
from test_service import (  # noqa: F401
    ADMIN,
    admin,
    cli,
    one_line_error,
    service,
    sha256,
    wait_for_progress,
    workers,
)
from test_service_calibration import (  # noqa: F401
    assert_same_tensors,
    digits,
    put_statistics,
    tiny_vit,
)

import fusekit
from conftest import mlp, write
from fusekit.client import Client
from fusekit.core.cross_stats import load_cross_statistics
from fusekit.core.model_spec import client_spec
from fusekit.core.stats import load_statistics
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.local import calibrate_locally

NAMES = ("clinic-a", "clinic-b", "clinic-c")  # as many as digits' shares
WIDTHS = (64, 32, 24, 16, 10)  # three hidden layers, each with BatchNorm


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[Path]:
    """Independently initialised BatchNorm MLPs (each its own seed)."""
    folder = tmp_path_factory.mktemp("round-clients")
    return [write(folder / f"{name}.safetensors", mlp(WIDTHS, batchnorm=True, seed=20 + i),
                  num_samples=400 + i) for i, name in enumerate(NAMES)]


def create(admin, service, models, **options) -> dict:  # noqa: F811
    """A job that calibrates, its checkpoints submitted, fused."""
    job = admin.create_job("pfnm", list(NAMES), params={"sweeps": 2}, auto_run=True,
                           calibrate=True, **options)
    for name, path in zip(NAMES, models, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job["id"], name, path)
    state = admin.wait(job["id"], timeout=120, every=0.1)
    assert state["state"] == "calibrating", state
    return job


class TakingPart(threading.Thread):
    """A client's every round (``Client.take_part``, with ``options``) in a thread of its
    own; ``join`` raises what it raised."""

    def __init__(self, service, job, name, model, inputs, folder, **options) -> None:  # noqa: F811
        super().__init__(name=name, daemon=True)
        self.args_ = (service.url, job, name, model, inputs, folder)
        self.options = options
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        url, job, name, model, inputs, folder = self.args_
        try:
            with Client(url, job["tokens"][name]) as client:
                client.take_part(job["id"], name, model, inputs, folder, timeout=120,
                                 every=0.1, **self.options)
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = 120) -> None:
        self.join(timeout)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error


def files_of(folder: Path, name: str, index: int) -> Path:
    return folder / f"{name}.round-{index}.stats.safetensors"


def test_layerwise_job_with_input_moments_equals_the_library(
        service, admin, models, digits, tmp_path, monkeypatch):  # noqa: F811
    """Three clients (two through Client.take_part, one through `fusekit contribute`) run
    a layer-by-layer job: the first layer derived from their targets' input moments, then
    one eval-mode round per BatchNorm layer. The result equals fusekit.calibrate applied
    round by round to the same files, and calibrate_locally with the same data."""
    job = create(admin, service, models, protocol="layerwise", input_moments=True)
    job_id = job["id"]
    state = admin.status(job_id)
    assert state["protocol"] == "layerwise" and state["input_moments"]
    first = state["round"]
    assert (first["index"], first["total"], first["kind"]) == (1, 3, "derived")
    assert first["layers"] == ["0"] and "from the input moments" in first["asks"]
    assert state["waiting_for"] == {"statistics": [], "targets": list(NAMES)}
    folders = {name: tmp_path / name for name in NAMES}
    threads = [TakingPart(service, job, name, model, x, folders[name])
               for name, model, x in zip(NAMES[:2], models, digits, strict=False)]
    data = tmp_path / "c.npz"
    np.savez(data, x_train=digits[2], y_train=np.zeros(len(digits[2]), np.int64),
             x_test=digits[2][:10], y_test=np.zeros(10, np.int64))
    monkeypatch.setenv("FUSEKIT_TOKEN", job["tokens"][NAMES[2]])
    took = cli("contribute", service.url, models[2], "--job", job_id, "--client", NAMES[2],
               "--data-path", data, "--work-dir", folders[NAMES[2]], "--timeout", "120")
    for thread in threads:
        thread.finish()
    assert took.exit_code == 0 and f"job {job_id}: succeeded" in took.stdout, took.output
    for thread in threads:
        thread.finish()
    state = admin.status(job_id)
    assert state["state"] == "succeeded" and state["round"]["index"] == 3, state

    fused = admin.fused(job_id, tmp_path / "fused.safetensors")
    targets = [folders[n] / f"{n}.targets.safetensors" for n in NAMES]
    assert all(load_statistics(t).inputs for t in targets)
    expected = fusekit.calibrate(fused, [], targets=targets, layers=["0"])
    for index, layer in ((2, "3"), (3, "6")):
        stats = [files_of(folders[n], n, index) for n in NAMES]
        assert load_statistics(stats[0]).model == _hash(expected)  # the round's model
        expected = fusekit.calibrate(_checkpoint(expected), stats, targets=targets,
                                     layers=[layer])
    result = admin.result(job_id, tmp_path / "calibrated.safetensors")
    assert_same_tensors(result, expected.state_dict)
    seen = [*digits[:2], load_dataset("npz", path=data).x_train]  # as `contribute` reads it
    local = calibrate_locally(fused, seen, clients=[fusekit.load_checkpoint(m) for m in models],
                              input_moments=True)
    for name, array in local.state_dict.items():
        np.testing.assert_allclose(fusekit.load_checkpoint(result).tensor(name), array,
                                   rtol=1e-6, atol=1e-6, err_msg=name)
    report = admin.report(job_id)["calibration"]
    assert report["protocol"] == "layerwise" and report["input_moments"]
    assert [r["kind"] for r in report["rounds"]] == ["derived", "statistics", "statistics"]
    assert [r["layers"] for r in report["rounds"]] == [["0"], ["3"], ["6"]]
    assert all(r["statistics_from"] == list(NAMES) for r in report["rounds"][1:])
    assert report["targets_from"] == list(NAMES)

    stale = files_of(folders[NAMES[0]], NAMES[0], 2).read_bytes()
    one_line_error(put_statistics(service, job_id, NAMES[0], job["tokens"][NAMES[0]], stale),
                   409, "has succeeded")


@pytest.mark.parametrize("input_moments", [False, True])
def test_plain_mlp_layerwise_job_repairs_paired_as_the_library(
        service, admin, digits, tmp_path, input_moments):  # noqa: F811
    """MLPs without BatchNorm: every round is REPAIR towards the clients' targets (sent by
    take_part in the first round), each fused neuron read on the data of the clients
    matched into it (paired: every client sent both), as fusekit.calibrate(...,
    paired=True) round by round and calibrate_locally (its default) give; with input
    moments the first layer is derived, paired too."""
    folder = tmp_path / "plain"
    folder.mkdir()
    plain = [write(folder / f"{name}.safetensors", mlp(WIDTHS, seed=30 + i),
                   num_samples=400 + i) for i, name in enumerate(NAMES)]
    job = create(admin, service, plain, protocol="layerwise", input_moments=input_moments)
    state = admin.status(job["id"])
    assert state["fused"]["needs_targets"] and state["round"]["total"] == 3
    asked = [] if input_moments else list(NAMES)
    assert state["waiting_for"] == {"statistics": asked, "targets": list(NAMES)}
    folders = {name: tmp_path / name for name in NAMES}
    for thread in [TakingPart(service, job, name, model, x, folders[name])
                   for name, model, x in zip(NAMES, plain, digits, strict=True)]:
        thread.finish()
    assert admin.status(job["id"])["state"] == "succeeded"
    targets = [folders[n] / f"{n}.targets.safetensors" for n in NAMES]
    first = [] if input_moments else [files_of(folders[n], n, 1) for n in NAMES]
    expected = fusekit.calibrate(admin.fused(job["id"], tmp_path / "fused.safetensors"),
                                 first, targets=targets, layers=["0"], paired=True)
    for index, layer in ((2, "2"), (3, "4")):
        expected = fusekit.calibrate(_checkpoint(expected),
                                     [files_of(folders[n], n, index) for n in NAMES],
                                     targets=targets, layers=[layer], paired=True)
    result = admin.result(job["id"], tmp_path / "calibrated.safetensors")
    assert_same_tensors(result, expected.state_dict)
    local = calibrate_locally(tmp_path / "fused.safetensors", digits,
                              clients=[fusekit.load_checkpoint(m) for m in plain],
                              input_moments=input_moments)
    for name, array in local.state_dict.items():
        np.testing.assert_allclose(fusekit.load_checkpoint(result).tensor(name), array,
                                   rtol=1e-6, atol=1e-6, err_msg=name)
    rounds = admin.report(job["id"])["calibration"]["rounds"]
    assert [r["calibration"]["paired"] for r in rounds] == [True] * 3


def _checkpoint(result) -> fusekit.Checkpoint:
    return fusekit.Checkpoint.from_state_dict(result.state_dict, result.metadata,
                                              source="expected")


def _hash(result) -> str:
    return _checkpoint(result).content_hash


def test_align_and_refit_job_equals_the_library_and_refuses_stale_rounds(
        service, admin, models, digits, tmp_path):  # noqa: F811
    """Alignment + refit: a one-pass calibration round, an alignment round (cross
    statistics against the calibrated model), one refit round per layer. Each client's
    contribute computes whatever the round asks; an upload of an earlier round's file is
    refused in one line naming the round; the admin finishes a statistics round with two
    clients' files; the result equals fusekit.calibrate, align and refit in process."""
    job = create(admin, service, models, protocol="align")
    job_id, tokens = job["id"], job["tokens"]
    state = admin.status(job_id)
    assert [state["round"][k] for k in ("index", "total", "kind", "mode")] == [
        1, 6, "statistics", "batch"]
    folders = {name: tmp_path / name for name in NAMES}
    with clients_of(service, tokens) as clients:
        for name, model, x in zip(NAMES[:2], models, digits, strict=False):
            clients[name].contribute(job_id, name, model, x, folders[name])
        assert admin.calibrate(job_id)["state"] == "queued"  # without the third's
        state = _next_round(admin, job_id, 2)
        assert state["round"]["kind"] == "cross" and "alignment" in state["round"]["asks"]
        assert state["rounds_done"][0]["missing"] == [NAMES[2]]
        stale = tmp_path / "stale.stats.safetensors"
        fusekit.core.stats.save_statistics(stale, client_statistics(
            admin.fused(job_id, tmp_path / "fused.safetensors"), digits[2], mode="batch"))
        error = one_line_error(put_statistics(service, job_id, NAMES[2], tokens[NAMES[2]],
                                              stale.read_bytes()), 409,
                               f"client '{NAMES[2]}': statistics for round 1, which is over; "
                               "the job is in round 2 of 6: cross statistics")
        assert "fusekit contribute" in error
        refused = httpx_put(service, job_id, NAMES[2], tokens[NAMES[2]], stale, round=1)
        one_line_error(refused, 409, "statistics for round 1, which is over")
        refused = httpx_put(service, job_id, NAMES[2], tokens[NAMES[2]], stale, round=3)
        one_line_error(refused, 409, "statistics for round 3, which has not started; the "
                       "job is in round 2 of 6")
        own = fusekit.core.stats.save_statistics(tmp_path / "own.stats.safetensors",
                                                 client_statistics(models[2], digits[2]))
        one_line_error(httpx_put(service, job_id, NAMES[2], tokens[NAMES[2]], own,
                                 kind="targets"), 409,
                       "its calibration has started; targets are accepted until it starts")
        for index in range(2, 7):
            for name, model, x in zip(NAMES, models, digits, strict=True):
                clients[name].contribute(job_id, name, model, x, folders[name])
            state = _next_round(admin, job_id, index + 1)
    assert state["state"] == "succeeded", state

    current = _aligned_and_refit(tmp_path / "fused.safetensors", models, folders, NAMES[:2])
    assert_same_tensors(admin.result(job_id, tmp_path / "result.safetensors"),
                        current.state_dict)
    report = admin.report(job_id)["calibration"]
    assert [r["kind"] for r in report["rounds"]] == ["statistics", "cross", *["refit"] * 4]
    assert report["rounds"][1]["alignment"]["mean_correlation"] > 0


def httpx_put(service, job_id, client, token, path, kind="statistics", **query):  # noqa: F811
    return http("PUT", f"{service.url}/v1/jobs/{job_id}/clients/{client}/{kind}",
                       params=query, content=path.read_bytes(),
                       headers={"Authorization": f"Bearer {token}"}, timeout=30)


@contextlib.contextmanager
def clients_of(service, tokens: dict[str, str]):
    """A Client per job client, by name, each closed at the end."""
    clients = {name: Client(service.url, tokens[name]) for name in NAMES}
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()


def _next_round(admin, job_id: str, index: int, timeout: float = 120) -> dict:  # noqa: F811
    """The job once in round ``index`` (or finished), polled for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        state = admin.status(job_id)
        if state["state"] in ("succeeded", "failed", "cancelled") or (
                state["state"] == "calibrating" and state["round"]["index"] >= index):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def _killed_in(server, admin, job_id: str, index: int, total: int) -> dict:  # noqa: F811
    """kill -9 of the server's worker while it computes round ``index``'s step; the job
    once past that round (its step run again by the worker the server starts)."""
    wait_for_progress(admin, job_id, f"round {index} of {total}: ", prefix=True)
    (worker,) = workers(server.process.pid)
    os.kill(worker, signal.SIGKILL)
    return _next_round(admin, job_id, index + 1)


@pytest.mark.spread  # a server of its own
def test_worker_killed_in_each_kind_of_round_and_server_restarted(models, digits, tmp_path):
    """kill -9 of the worker while it computes a round's step, in a layerwise and an align
    job: in a statistics round, a cross-statistics round, a refit round, and the last round
    of each job (the one whose step ends it). Each such round is run again from the files
    it received (the attempt limit, 3, counts per round, so the round runs twice and the
    job goes on), the rounds between run once, and the jobs end as the library does; kill -9
    of the server between rounds loses nothing."""
    server = ServiceProcess(tmp_path / "data", options=("--job-lease", "1"),
                            env={"FUSEKIT_ADMIN_TOKEN": ADMIN})
    server.start()
    try:
        with Client(server.url, ADMIN) as admin:  # noqa: F811
            def rounds_with_kills(job: dict, folders: dict[str, Path], total: int,
                                  killed: set[int]) -> dict:
                for index in range(1, total + 1):
                    for name, model, x in zip(NAMES, models, digits, strict=True):
                        with Client(server.url, job["tokens"][name]) as client:
                            client.contribute(job["id"], name, model, x, folders[name])
                    state = (_killed_in(server, admin, job["id"], index, total)
                             if index in killed else _next_round(admin, job["id"], index + 1))
                    if index < total:
                        assert state["state"] == "calibrating", state
                        assert state["step_attempts"] == 0 and state["round"]["index"] == (
                            index + 1), state
                    if index == 1:
                        server.kill()
                        server.start()
                        assert admin.status(job["id"])["round"] == state["round"]
                assert state["state"] == "succeeded", state
                assert state["attempts"] == 1 + total + len(killed), state
                return state

            job = create(admin, server, models, protocol="layerwise")
            job_id, folders = job["id"], {name: tmp_path / name for name in NAMES}
            rounds_with_kills(job, folders, 3, killed={1, 3})  # statistics rounds
            expected = fusekit.load_checkpoint(admin.fused(job_id, tmp_path / "f.safetensors"))
            for index, layer in zip((1, 2, 3), ("0", "3", "6"), strict=True):
                expected = _checkpoint(fusekit.calibrate(
                    expected, [files_of(folders[n], n, index) for n in NAMES],
                    layers=[layer]))
            assert_same_tensors(admin.result(job_id, tmp_path / "r.safetensors"),
                                expected.state_dict())
            folder = server.data_dir / "jobs" / job_id
            assert not list((folder / "rounds").iterdir())  # the rounds' models swept
            kept = sorted(p.name for p in (folder / "statistics").iterdir())  # the last round's
            assert kept == sorted(f"{n}.{sha256(files_of(folders[n], n, 3))}.safetensors"
                                  for n in NAMES)

            job = create(admin, server, models, protocol="align")
            folders = {name: tmp_path / "align" / name for name in NAMES}
            rounds_with_kills(job, folders, 6, killed={1, 2, 3, 6})  # statistics, cross, refit
            fused = admin.fused(job["id"], tmp_path / "fused-align.safetensors")
            assert_same_tensors(admin.result(job["id"], tmp_path / "ra.safetensors"),
                                _aligned_and_refit(fused, models, folders, NAMES).state_dict)
    finally:
        server.stop()


def _aligned_and_refit(fused: Path, models: list[Path], folders: dict[str, Path],
                       first_round: tuple[str, ...]):
    """What fusekit.calibrate, align and refit give with the files of an align job's six
    rounds (the first round's of the clients ``first_round``, every client's after)."""
    current = fusekit.calibrate(fused, [files_of(folders[n], n, 1) for n in first_round])
    cross = [files_of(folders[n], n, 2) for n in NAMES]
    assert load_cross_statistics(cross[0]).reference == _hash(current)
    current = fusekit.align(_checkpoint(current), models, cross)
    for index, layer in zip(range(3, 7), ("0", "3", "6", "9"), strict=True):
        current = fusekit.refit(_checkpoint(current), models,
                                [files_of(folders[n], n, index) for n in NAMES])
        assert current.report["refit"]["layers"][-1] == layer
    return current


def test_a_transformer_jobs_models_come_with_its_config(service, admin, tmp_path):  # noqa: F811
    """A transformer job given its clients' config.json: pfnm at 1.5x widens the MLPs, and
    the fused model, each round's model and the result download as model folders whose
    config.json has the fused width, so that clients can run them for statistics."""
    names = NAMES[:2]
    folders = [tiny_vit(tmp_path / name, seed=i) for i, name in enumerate(names)]
    spec = client_spec(fusekit.load_checkpoint(folders[0]), None).to_json()
    config = json.loads((folders[0] / "config.json").read_text())
    job = admin.create_job("pfnm", list(names), params={"width_ratio": 1.5}, spec=spec,
                           auto_run=True, calibrate=True, config=config)
    job_id, rng = job["id"], np.random.default_rng(0)
    inputs = [rng.normal(size=(40, 1, 8, 8)).astype(np.float32) for _ in names]
    for name, folder in zip(names, folders, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job_id, name, folder / "model.safetensors")
    state = admin.wait(job_id, timeout=120, every=0.1)
    assert state["state"] == "calibrating" and state["config"], state
    threads = [TakingPart(service, job, name, folder, x, tmp_path / f"work-{name}")
               for name, folder, x in zip(names, folders, inputs, strict=True)]
    for thread in threads:
        thread.finish()
    state = admin.status(job_id)
    assert state["state"] == "succeeded", state
    result = admin.result(job_id, tmp_path / "result")
    fused = admin.fused(job_id, tmp_path / "fused")
    width = json.loads((result / "config.json").read_text())["intermediate_size"]
    assert width > config["intermediate_size"]
    assert fusekit.load_checkpoint(result).tensor(
        "vit.encoder.layer.0.intermediate.dense.weight").shape[0] == width
    stats = [tmp_path / f"work-{n}" / f"{n}.round-1.stats.safetensors" for n in names]
    targets = [tmp_path / f"work-{n}" / f"{n}.targets.safetensors" for n in names]
    assert_same_tensors(result / "model.safetensors",
                        fusekit.calibrate(fused, stats, targets=targets).state_dict)
    transformers = pytest.importorskip("transformers")
    model = transformers.ViTForImageClassification.from_pretrained(result)
    assert model.config.intermediate_size == width


@pytest.mark.spread  # a server of its own
def test_a_job_fused_before_rounds_existed_calibrates_after_an_upgrade(models, digits,
                                                                        tmp_path):
    """A job.json written by the version without rounds (fused, calibrating, no ``round``)
    is read as its one-pass round: the statistics of its fused model are taken and the
    job calibrates as fusekit.calibrate does."""
    server = ServiceProcess(tmp_path / "data", env={"FUSEKIT_ADMIN_TOKEN": ADMIN})
    server.start()
    try:
        with Client(server.url, ADMIN) as admin:  # noqa: F811
            job = create(admin, server, models)
            server.kill()
            record = server.data_dir / "jobs" / job["id"] / "job.json"
            old = json.loads(record.read_text())
            for key in ("round", "plan", "rounds_done", "protocol", "input_moments", "config"):
                old.pop(key)
            old["fused"]["max_statistics_bytes"] = 2**20
            old["fused"].pop("config")
            record.write_text(json.dumps(old))
            server.start()
            state = admin.status(job["id"])
            assert state["protocol"] == "one-pass" and state["round"]["kind"] == "statistics"
            fused = admin.fused(job["id"], tmp_path / "fused.safetensors")
            stats = []
            for name, x in zip(NAMES, digits, strict=True):
                stats.append(tmp_path / f"{name}.stats.safetensors")
                fusekit.core.stats.save_statistics(stats[-1], client_statistics(
                    fused, x, mode="batch"))
                with Client(server.url, job["tokens"][name]) as client:
                    client.submit_statistics(job["id"], name, stats[-1])
            state = admin.wait(job["id"], timeout=120, every=0.1)
            assert state["state"] == "succeeded", state
            assert_same_tensors(admin.result(job["id"], tmp_path / "r.safetensors"),
                                fusekit.calibrate(fused, stats).state_dict)
    finally:
        server.stop()


def test_a_protocol_a_transformer_job_cannot_run_is_refused_when_the_job_is_created(
        service, tmp_path, monkeypatch):  # noqa: F811
    """A job whose config.json or spec says it fuses transformers, asking for rounds that
    only MLPs, CNNs and ResNets have, is refused before any upload: 422 and one line over
    HTTP, exit 2 from `fusekit job create`."""
    config = {"model_type": "vit", "hidden_size": 16, "intermediate_size": 24}
    spec = {"format": fusekit.core.transformer.TRANSFORMER_FORMAT}
    for protocol, known in (("layerwise", {"config": config}), ("align", {"spec": spec})):
        response = http("POST", f"{service.url}/v1/jobs", json={
            "method": "pfnm", "clients": list(NAMES), "calibrate": True, "protocol": protocol,
            **known}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        one_line_error(response, 422, "protocol", "transformer", "expected protocol 'one-pass'",
                       f"found {protocol!r}")
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("FUSEKIT_SERVER", service.url)
    monkeypatch.setenv("FUSEKIT_ADMIN_TOKEN", ADMIN)
    refused = cli("job", "create", "--method", "pfnm", "--clients", ",".join(NAMES),
                  "--calibrate", "--protocol", "align", "--config", tmp_path / "config.json")
    assert refused.exit_code == 2 and "config given" in refused.output, refused.output
    assert "found 'align'" in refused.output


def test_a_protocol_known_only_once_fused_to_be_impossible_fails_the_job(
        service, admin, tmp_path):  # noqa: F811
    """What the request cannot say (here: the fused model has no hidden layer) is refused
    after fusion, the fallback: the job fails with one line naming the protocol."""
    clients = [write(tmp_path / f"{name}.safetensors", mlp((64, 10), seed=40 + i),
                     num_samples=100) for i, name in enumerate(NAMES)]
    job = admin.create_job("avg", list(NAMES), auto_run=True, calibrate=True,
                           protocol="layerwise")
    for name, path in zip(NAMES, clients, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job["id"], name, path)
    state = admin.wait(job["id"], timeout=120, every=0.1)
    assert state["state"] == "failed", state
    assert "protocol 'layerwise'" in state["error"] and "no hidden layer" in state["error"]
    assert "\n" not in state["error"]


def test_rounds_finished_early_go_on_with_the_clients_that_answered(
        service, admin, models, digits, tmp_path):  # noqa: F811
    """The admin finishes the alignment round with two clients' cross statistics: the
    third takes no part in the refit rounds (its upload refused in one line, its status
    says so). The first refit round, finished early with one participant's statistics,
    refits with that one's (the protocol's rule for a client that did not answer); the
    other takes part again in the next refit round. The result equals fusekit.calibrate
    over the three clients' first-round files, then fusekit.align and refit in process
    over those who sent theirs."""
    job = create(admin, service, models, protocol="align")
    job_id, tokens = job["id"], job["tokens"]
    folders = {name: tmp_path / name for name in NAMES}
    sent, out = dict(zip(NAMES[:2], zip(models, digits, strict=False), strict=False)), NAMES[2]
    first, late = NAMES[:2]
    with clients_of(service, tokens) as clients:
        for name, model, x in zip(NAMES, models, digits, strict=True):
            clients[name].contribute(job_id, name, model, x, folders[name])
        assert _next_round(admin, job_id, 2)["round"]["kind"] == "cross"
        for name, (model, x) in sent.items():
            clients[name].contribute(job_id, name, model, x, folders[name])
        assert admin.calibrate(job_id)["state"] == "queued"
        state = _next_round(admin, job_id, 3)
        assert state["round"]["kind"] == "refit" and state["rounds_done"][1]["missing"] == [out]
        assert state["round"]["participants"] == list(sent)
        assert clients[out].status(job_id)["round"]["taking_part"] is False
        stale = fusekit.core.stats.save_statistics(
            folders[out] / "own.stats.safetensors", client_statistics(models[2], digits[2]))
        one_line_error(put_statistics(service, job_id, out, tokens[out], stale.read_bytes()),
                       409, f"client {out!r}: takes no part in the job's rounds since its "
                       "alignment round")
        clients[first].contribute(job_id, first, *sent[first], folders[first])
        assert admin.calibrate(job_id)["state"] == "queued"
        state = _next_round(admin, job_id, 4)
        assert state["round"]["participants"] == list(sent)
        for index in range(4, 7):
            for name, (model, x) in sent.items():
                clients[name].contribute(job_id, name, model, x, folders[name])
            state = _next_round(admin, job_id, index + 1)
    assert state["state"] == "succeeded", state
    current = fusekit.calibrate(admin.fused(job_id, tmp_path / "fused.safetensors"),
                                [files_of(folders[n], n, 1) for n in NAMES])
    current = fusekit.align(_checkpoint(current), models[:2],
                            [files_of(folders[n], n, 2) for n in sent])
    for index in range(3, 7):
        who = [first] if index == 3 else list(sent)
        current = fusekit.refit(_checkpoint(current), [models[NAMES.index(n)] for n in who],
                                [files_of(folders[n], n, index) for n in who])
    assert_same_tensors(admin.result(job_id, tmp_path / "result.safetensors"),
                        current.state_dict)
    rounds = admin.report(job_id)["calibration"]["rounds"]
    assert [r["missing"] for r in rounds] == [[], [out], [late], [], [], []]
