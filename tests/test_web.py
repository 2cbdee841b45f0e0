"""The service's web page, in a real browser: Debian's headless ``chromium`` driven by
Selenium through ``chromedriver``, against a real ``fusekit serve`` on 127.0.0.1 (the
fixtures of test_service.py). Without the browser, the browser tests are skipped with the
reason (``-ra`` prints it); the page's routes and JSON are tested over HTTP either way.

``FUSEKIT_SCREENSHOTS=docs/images`` saves a screenshot of each page there (those of
docs/service.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from bench_service import ServiceProcess, http
from test_service import ADMIN, admin, models, one_line_error, put, service  # noqa: F401

from conftest import mlp, write
from fusekit.client import Client, ServiceError
from fusekit.core.model_spec import client_spec
from fusekit.methods import METHODS
from fusekit.methods.params import method_params
from fusekit.service.app import REQUEST_KINDS
from fusekit.service.web import STATIC
from fusekit.toolkit.processes import end_groups

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60  # the longest any one wait on the page may take
SHOTS = os.environ.get("FUSEKIT_SCREENSHOTS")


# -- over HTTP: the pages' routes and the JSON they use --------------------------------------

def test_pages_and_their_files_are_served_from_this_server_only(service):
    assert f"web page: {service.url}/ " in service.log.read_text()  # fusekit serve says where
    for path in ("/", "/upload"):
        page = http("GET", service.url + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        linked = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
        assert linked and all(link.startswith("/static/") for link in linked), linked
        for link in linked:
            assert http("GET", service.url + link).status_code == 200, link
    for file in STATIC.iterdir():  # nothing fetched from elsewhere at run time
        urls = set(re.findall(r"https?://[^\s\"'`)]+", file.read_text()))
        assert urls <= {"http://www.w3.org/2000/svg"}, (file.name, urls)
    one_line_error(http("GET", service.url + "/static/nope.js"), 404, "/static/nope.js")


def test_the_static_files_are_package_data(tmp_path):
    """What a wheel holds (setuptools' build_py, which a wheel is made of), not only an
    editable install, carries every file the page needs."""
    built = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; "
         f"setup(script_args=['-q', 'egg_info', '--egg-base', {str(tmp_path)!r}, "
         f"'build_py', '-d', {str(tmp_path)!r}])"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    packaged = tmp_path / "fusekit" / "service" / "static"
    assert sorted(p.name for p in packaged.iterdir()) == sorted(p.name for p in STATIC.iterdir())


def test_methods_lists_every_parameter_a_job_may_set_as_declared(service):
    methods = http("GET", f"{service.url}/v1/methods").json()["methods"]  # no token needed
    assert [m["name"] for m in methods] == sorted(METHODS)
    for listed in methods:
        declared = [s.to_json() for s in method_params(METHODS[listed["name"]])
                    if s.kind in REQUEST_KINDS]
        assert listed["params"] == declared
    ot = next(m for m in methods if m["name"] == "ot")
    assert "activations" not in {p["name"] for p in ot["params"]}  # a Python object
    sweeps = next(p for p in next(m for m in methods if m["name"] == "pfnm")["params"]
                  if p["name"] == "sweeps")
    assert sweeps == {**sweeps, "kind": "int", "default": 5, "minimum": 0, "maximum": 1000}


def test_job_list_is_the_admins_only(service, admin, models):  # noqa: F811
    job = admin.create_job("avg", ["a", "b"])
    admin.submit(job["id"], "a", models[0])
    url = f"{service.url}/v1/jobs"
    one_line_error(http("GET", url), 401, "Bearer")
    one_line_error(http("GET", url, headers={"Authorization": f"Bearer {job['tokens']['a']}"}),
                   403, "admin")
    jobs = http("GET", url, headers={"Authorization": f"Bearer {ADMIN}"}).json()["jobs"]
    mine = next(j for j in jobs if j["id"] == job["id"])
    assert mine == {**mine, "method": "avg", "state": "collecting", "clients": 2, "filled": 1}
    assert [j["created_at"] for j in jobs] == sorted((j["created_at"] for j in jobs),
                                                     reverse=True)
    admin.delete(job["id"])
    jobs = http("GET", url, headers={"Authorization": f"Bearer {ADMIN}"}).json()["jobs"]
    assert job["id"] not in {j["id"] for j in jobs}


# -- in the browser --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium under chromedriver, each in its own process group (ended after)."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (the [test] extra has it)")
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("browser tests: Debian's chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1100,800", "--no-first-run", "--disable-extensions",
                     "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--lang=en-GB"):
        options.add_argument(argument)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    service = Service(driver_path, log_output=str(downloads.parent / "chromedriver.log"),
                      popen_kw={"start_new_session": True})
    try:
        driver = webdriver.Chrome(options=options, service=service)
    except WebDriverException as exc:
        if service.process is not None:
            end_groups([service.process])
        pytest.skip(f"browser tests: chromium could not be started: {exc.msg}")
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    driver.downloads = downloads
    try:
        yield driver
    finally:
        with contextlib.suppress(WebDriverException):
            driver.quit()
        end_groups([service.process])  # chromium too, should quit have left it


@pytest.fixture(scope="module")
def big_service(tmp_path_factory):
    """A server taking checkpoints large enough that fusion runs for seconds, long
    enough for the page's progress to be seen."""
    server = ServiceProcess(tmp_path_factory.mktemp("web") / "data",
                            options=("--max-checkpoint-bytes", str(8 * 2**20)),
                            env={"FUSEKIT_ADMIN_TOKEN": ADMIN})
    server.start()
    yield server
    server.stop()


def wait_for(driver, condition, what: str, timeout: float = WAIT_S):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException)).until(condition, what)


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def select_all(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def shoot(driver, name: str) -> None:
    """A screenshot of the whole page into $FUSEKIT_SCREENSHOTS (as web-<name>.png, in 64
    colours), when it is set; and no page shows JavaScript's values for what is missing."""
    text = by_id(driver, "main").text
    assert not re.search(r"\bundefined\b|\bNaN\b|\[object |^(false|null)$", text, re.M), text
    if not SHOTS:
        return
    from PIL import Image  # matplotlib's, in the [bench] extra

    height, chrome = driver.execute_script(
        "return [document.body.scrollHeight, window.outerHeight - window.innerHeight]")
    driver.set_window_size(1100, min(height, 2400) + chrome)
    time.sleep(0.2)
    path = Path(SHOTS) / f"web-{name}.png"
    driver.save_screenshot(str(path))
    Image.open(path).convert("RGB").quantize(64, dither=Image.Dither.NONE).save(path,
                                                                                 optimize=True)
    driver.set_window_size(1100, 800)


def sign_in(driver, url: str, token: str) -> None:
    driver.get(url + "/")
    driver.execute_script("sessionStorage.clear()")  # signed out, whatever came before
    driver.refresh()
    field = wait_for(driver, lambda d: by_id(d, "admin-token"), "the sign-in form")
    field.send_keys(token)
    select_all(driver, "#sign-in button")[0].click()


def upload(driver, url: str, job: str, client: str, token: str, path: Path) -> str:
    """The client's page: the link's address, the token typed, the file picked; the verdict."""
    driver.get(f"{url}/upload?job={job}&client={client}")
    by_id(driver, "token").send_keys(token)
    by_id(driver, "file").send_keys(str(path))
    by_id(driver, "send").click()
    return wait_for(driver, lambda d: by_id(d, "verdict").get_attribute("class") in (
        "accepted", "refused") and by_id(d, "verdict").text, "the server's verdict")


def offered(driver, label: str):
    """The upload page's download button, once the token typed has shown what it offers."""
    return wait_for(driver, lambda d: by_id(d, "fetch-fused").is_displayed() and by_id(
        d, "fetch-fused").text == label and by_id(d, "fetch-fused"), f"the {label!r} button")


def on_one_line(driver, element) -> bool:
    return driver.execute_script("const r = document.createRange(); "
                                 "r.selectNodeContents(arguments[0]); "
                                 "return r.getClientRects().length === 1", element)


def api_error(response: httpx.Response) -> str:
    return f"{response.json()['error']} (HTTP {response.status_code})"


def test_nothing_is_shown_before_the_admin_token_and_a_wrong_one_is_refused(browser, service):
    browser.get(service.url + "/")
    wait_for(browser, lambda d: by_id(d, "admin-token"), "the sign-in form")
    shoot(browser, "sign-in")
    assert not by_id(browser, "nav").is_displayed()
    assert not select_all(browser, "#jobs, #create, #job")
    sign_in(browser, service.url, "forged")
    shown = wait_for(browser, lambda d: by_id(d, "sign-in-error").text, "the refusal")
    expected = api_error(http("GET", f"{service.url}/v1/jobs",
                                     headers={"Authorization": "Bearer forged"}))
    assert shown == expected
    assert not select_all(browser, "#jobs")
    assert browser.execute_script("return sessionStorage.length + localStorage.length") == 0


def test_chart_ticks_tell_close_values_apart(browser, service):
    """An objective that moves from 21034 to 21466 over the sweeps: each y tick its own
    label (every tick read 2.1e+4), in the page's own chart code."""
    browser.get(service.url + "/")
    wait_for(browser, lambda d: by_id(d, "admin-token"), "the page")
    ticks = browser.execute_script(
        "const chart = fkCharts.lines('Objective per sweep', 'objective', 'sweep', "
        "[{name: 'layer 0', values: [21034, 21250, 21466]}]); "
        "return Array.from(chart.querySelectorAll('text.tick'), (t) => t.textContent);")
    assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), ticks
    assert ticks[0] == "21000", ticks


def test_the_form_has_a_field_for_each_declared_parameter(browser, service):
    from selenium.webdriver.support.ui import Select

    sign_in(browser, service.url, ADMIN)
    wait_for(browser, lambda d: by_id(d, "nav").is_displayed(), "signed in")
    browser.get(service.url + "/#new")
    method = Select(wait_for(browser, lambda d: by_id(d, "method"), "the form"))
    for name, cls in METHODS.items():
        method.select_by_value(name)
        fields = {e.get_attribute("data-param") for e in select_all(browser, "[data-param]")}
        assert fields == {s.name for s in method_params(cls) if s.kind in REQUEST_KINDS}, name


def test_coordinator_and_two_clients_in_the_browser(browser, big_service, tmp_path):
    url, driver = big_service.url, browser
    names = ("hospital-a", "hospital-b")
    # Wide enough that each layer's matching outlasts the page's poll (0.5 s) on a quiet
    # machine: about 0.8 s a layer, so "layer i of 3" is on the page for two polls or more.
    paths = [write(tmp_path / f"{n}.safetensors", mlp((64, 800, 800, 800, 10), seed=i),
                   num_samples=10 + i) for i, n in enumerate(names)]
    sign_in(driver, url, ADMIN)
    wait_for(driver, lambda d: by_id(d, "nav").is_displayed(), "signed in")
    assert driver.execute_script(
        "return [sessionStorage.getItem('fusekit.admin-token'), localStorage.length]") == [
        ADMIN, 0]

    driver.get(url + "/#new")
    wait_for(driver, lambda d: by_id(d, "param-sweeps"), "the pfnm parameters")
    by_id(driver, "clients").send_keys(", ".join(names))
    by_id(driver, "param-sigma").send_keys("1.0")
    by_id(driver, "param-sweeps").send_keys("3")
    shoot(driver, "new-job")
    select_all(driver, "#create button[type=submit]")[0].click()
    table = wait_for(driver, lambda d: by_id(d, "tokens"), "the clients' tokens")
    fields = [e.get_attribute("value") for e in table.find_elements("css selector", "input")]
    tokens = dict(zip(names, fields[0::2], strict=True))
    links = dict(zip(names, fields[1::2], strict=True))
    job_id = re.fullmatch(r"Job ([0-9a-f]{32}) created", select_all(driver, "h2")[0].text)[1]
    driver.execute_cdp_cmd("Browser.grantPermissions", {
        "origin": url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    copy = table.find_elements("css selector", "button.copy")[0]
    copy.click()
    wait_for(driver, lambda d: copy.text == "Copied", "the token copied")
    assert driver.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0])") == tokens[names[0]]
    shoot(driver, "tokens")
    with Client(url, ADMIN) as admin:
        job = admin.status(job_id)
        assert job["method"] == "pfnm" and job["params"] == {"sigma": 1.0, "sweeps": 3}
        for name in names:
            assert links[name] == f"{url}/upload?job={job_id}&client={name}"
            assert tokens[name] not in links[name]
            with Client(url, tokens[name]) as client:  # each token is that client's
                assert client.status(job_id)["client"] == name

        for name, path in zip(names, paths, strict=True):
            verdict = upload(driver, url, job_id, name, tokens[name], path)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert verdict.startswith(f"Accepted: {path.name}, {path.stat().st_size} bytes, "
                                      f"SHA-256 {digest}"), verdict
            assert by_id(driver, "progress").get_attribute("value") == str(path.stat().st_size)
            assert "(100%)" in by_id(driver, "progress-text").text
            assert admin.status(job_id)["slots"][name]["sha256"] == digest
        shoot(driver, "upload")

        driver.get(f"{url}/#")
        row = wait_for(driver, lambda d: select_all(d, f"tr[data-job='{job_id}']"), "the job")[0]
        assert row.text.split()[:4] == [job_id[:8], "pfnm", "collecting", "2"], row.text
        shoot(driver, "jobs")
        driver.get(f"{url}/#job/{job_id}")
        run = wait_for(driver, lambda d: by_id(d, "run").is_enabled() and by_id(d, "run"),
                       "the Run button")
        rows = select_all(driver, "#slots tbody tr")
        assert [r.get_attribute("data-client") for r in rows] == list(names)
        for row, path in zip(rows, paths, strict=True):
            assert hashlib.sha256(path.read_bytes()).hexdigest() in row.text
        driver.set_window_size(640, 800)  # a narrow window: the SHA-256s wrap, not the names
        for row in select_all(driver, "#slots tbody tr"):
            name = row.find_element("css selector", "td:first-child")
            assert on_one_line(driver, name), name.text
        driver.set_window_size(1100, 800)
        shoot(driver, "job-collecting")
        driver.execute_script(  # every progress text the page shows, as it polls
            "window.seen = []; new MutationObserver(() => { const p = "
            "document.getElementById('progress-text'); if (p) window.seen.push([p.textContent,"
            " document.getElementById('job-progress')?.value]); })"
            ".observe(document.getElementById('main'), {childList: true, subtree: true});")
        run.click()
        if SHOTS:  # the bar while it runs, if a poll lands in time
            with contextlib.suppress(Exception):
                wait_for(driver, lambda d: by_id(d, "job-progress"), "progress", timeout=10)
                shoot(driver, "job-running")
        wait_for(driver, lambda d: by_id(d, "job").get_attribute("data-state") in (
            "succeeded", "failed"), "the job to finish", timeout=120)
        assert by_id(driver, "job").get_attribute("data-state") == "succeeded"
        seen = driver.execute_script("return window.seen")
        layers = [(text, value) for text, value in seen if "layer" in text]
        assert layers, seen  # "fusing: layer i of 3 matched", with its bar at i
        for text, value in layers:
            assert re.fullmatch(r"fusing: layer ([123]) of 3 matched", text)[1] == str(value)

        charts = wait_for(driver, lambda d: select_all(d, "#report svg.chart"), "the report")
        titles = [c.find_element("css selector", "title").get_attribute("textContent")
                  for c in charts]
        assert titles == ["Fused width per layer", "Objective per sweep",
                          "Matching time per layer"]
        report = admin.report(job_id)
        bars = charts[0].find_elements("css selector", "rect.bar title")
        fused = [b.get_attribute("textContent") for b in bars if ", fused:" in b.get_attribute(
            "textContent")]
        assert fused == [f"layer {layer['layer']}, fused: {layer['width']}"
                         for layer in report["report"]["layers"]]
        assert len(charts[1].find_elements("css selector", "polyline")) == 3
        for chart in charts:  # each tick its own label (the objective's all read 2.1e+4)
            ticks = [t.get_attribute("textContent")
                     for t in chart.find_elements("css selector", "text.tick")]
            assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), ticks
        shoot(driver, "job-succeeded")

        by_id(driver, "download").click()
        saved = driver.downloads / f"fused-{job_id}.safetensors"
        wait_for(driver, lambda d: saved.exists() and not list(
            driver.downloads.glob("*.crdownload")), "the download")
        assert saved.read_bytes() == admin.result(job_id, tmp_path / "api.safetensors"
                                                  ).read_bytes()

        by_id(driver, "delete").click()
        wait_for(driver, lambda d: d.switch_to.alert, "the confirmation").accept()
        wait_for(driver, lambda d: select_all(d, "#jobs") or "No jobs" in d.page_source,
                 "the jobs list")
        with pytest.raises(ServiceError, match="no such job"):
            admin.status(job_id)


def test_the_upload_page_refuses_as_the_api_does(browser, service, admin, models):  # noqa: F811
    job = admin.create_job("avg", ["a", "b"], max_checkpoint_bytes=300)
    body = models[0].read_bytes()
    assert len(body) > 300
    cases = [  # (client page, token, what the API answers the same upload)
        ("a", "forged", put(service, job["id"], "a", "forged", body)),
        ("b", job["tokens"]["a"], put(service, job["id"], "b", job["tokens"]["a"], body)),
        ("a", job["tokens"]["a"], put(service, job["id"], "a", job["tokens"]["a"], body)),
    ]
    assert [answer.status_code for *_, answer in cases] == [403, 403, 413]
    for client, token, answer in cases:
        verdict = upload(browser, service.url, job["id"], client, token, models[0])
        assert verdict == f"Refused: {api_error(answer)}"
        if answer.status_code == 413:
            shoot(browser, "upload-refused")
    assert not any(slot["filled"] for slot in admin.status(job["id"])["slots"].values())
    browser.get(f"{service.url}/upload?job={job['id']}")  # a link without the client's name
    verdict = wait_for(browser, lambda d: by_id(d, "verdict").text, "the page's answer")
    assert "lacks the job id or the client name" in verdict
    assert not by_id(browser, "upload-form").is_displayed()


def test_a_client_downloads_a_plain_jobs_fused_model_once_it_has_succeeded(
        browser, service, admin, models, tmp_path):  # noqa: F811
    """The upload page offers the download only where it works: not while the job collects,
    and, once it has succeeded, the fused model a job without calibration gives its clients."""
    job = admin.create_job("pfnm", ["a", "b"])  # the models differ in width
    page = f"{service.url}/upload?job={job['id']}&client=a"
    browser.get(page)
    by_id(browser, "token").send_keys(job["tokens"]["a"])
    hint = wait_for(browser, lambda d: by_id(d, "offer-hint").text, "what the page offers")
    assert hint == ("Nothing to download now: the job is collecting; its fused model comes "
                    "once it has succeeded.")
    assert not by_id(browser, "fetch-fused").is_displayed()
    for name, path in zip(("a", "b"), models, strict=False):
        admin.submit(job["id"], name, path)
    admin.run(job["id"])
    assert admin.wait(job["id"], timeout=60, every=0.1)["state"] == "succeeded"
    browser.get(page)
    by_id(browser, "token").send_keys(job["tokens"]["a"])
    offered(browser, "Download the fused model").click()
    fused = browser.downloads / f"fused-{job['id']}.safetensors"
    wait_for(browser, lambda d: fused.exists() and not list(
        browser.downloads.glob("*.crdownload")), "the fused model")
    assert fused.read_bytes() == admin.result(job["id"], tmp_path / "r.safetensors").read_bytes()
    assert "The fused model is downloaded" in by_id(browser, "verdict").text
    shoot(browser, "upload-fused")


def test_a_failed_job_shows_its_error(browser, service, admin, tmp_path):  # noqa: F811
    a = write(tmp_path / "a.safetensors", mlp((6, 5, 3), seed=0))
    b = write(tmp_path / "b.safetensors", mlp((6, 5, 4, 3), seed=1))  # another architecture
    job = admin.create_job("avg", ["a", "b"], auto_run=True)
    for name, path in (("a", a), ("b", b)):
        admin.submit(job["id"], name, path)
    error = admin.wait(job["id"], timeout=60, every=0.1)["error"]
    assert error
    sign_in(browser, service.url, ADMIN)
    wait_for(browser, lambda d: by_id(d, "nav").is_displayed(), "signed in")
    browser.get(f"{service.url}/#job/{job['id']}")
    assert wait_for(browser, lambda d: by_id(d, "job-error").text, "the error") == error
    assert by_id(browser, "job").get_attribute("data-state") == "failed"
    assert not by_id(browser, "download").is_enabled() and not by_id(browser, "run").is_enabled()
    assert not select_all(browser, "#report")
    shoot(browser, "job-failed")


def test_a_calibrating_job_in_the_browser(browser, service, admin, tmp_path):  # noqa: F811
    """The form's calibrate box; a client fetching the fused model and uploading its
    statistics on its page, another its targets (statistics of its own model); the job
    page's statistics and targets, Calibrate now and downloads."""
    from fusekit.core.stats import save_statistics
    from fusekit.toolkit.calibration import client_statistics

    names = ("hospital-a", "hospital-b")
    paths = [write(tmp_path / f"{n}.safetensors", mlp((6, 8, 5, 3), batchnorm=True, seed=i),
                   num_samples=40 + i) for i, n in enumerate(names)]
    sign_in(browser, service.url, ADMIN)
    wait_for(browser, lambda d: by_id(d, "nav").is_displayed(), "signed in")
    browser.get(service.url + "/#new")
    wait_for(browser, lambda d: by_id(d, "param-sweeps"), "the form")
    by_id(browser, "clients").send_keys(", ".join(names))
    by_id(browser, "auto-run").click()
    by_id(browser, "calibrate").click()
    select_all(browser, "#create button[type=submit]")[0].click()
    wait_for(browser, lambda d: by_id(d, "tokens"), "the clients' tokens")
    job_id = re.fullmatch(r"Job ([0-9a-f]{32}) created", select_all(browser, "h2")[0].text)[1]
    job = admin.status(job_id)
    assert job["calibrate"] and job["auto_run"]
    tokens = {}
    for name, path in zip(names, paths, strict=True):  # the tokens shown, in page order
        row = select_all(browser, "#tokens tbody tr")[names.index(name)]
        tokens[name] = row.find_elements("css selector", "input")[0].get_attribute("value")
        with Client(service.url, tokens[name]) as client:
            client.submit(job_id, name, path)
    assert admin.wait(job_id, timeout=60, every=0.1)["state"] == "calibrating"

    browser.get(f"{service.url}/upload?job={job_id}&client={names[0]}")
    by_id(browser, "token").send_keys(tokens[names[0]])
    offered(browser, "Download the fused model").click()
    fused = browser.downloads / f"round-1-{job_id}.safetensors"  # the first round's: fused
    wait_for(browser, lambda d: fused.exists() and not list(
        browser.downloads.glob("*.crdownload")), "the fused model")
    assert fused.read_bytes() == admin.fused(job_id, tmp_path / "f.safetensors").read_bytes()
    inputs = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    stats = save_statistics(tmp_path / "a.stats.safetensors",
                            client_statistics(fused, inputs, mode="batch"))
    verdict = upload(browser, service.url, job_id, names[0], tokens[names[0]], stats)
    assert verdict.startswith(f"Accepted: {stats.name}, {stats.stat().st_size} bytes"), verdict
    assert "before the job calibrates" in verdict
    assert admin.status(job_id)["statistics"][names[0]]["filled"]
    targets = save_statistics(tmp_path / "b.targets.safetensors",
                              client_statistics(paths[1], inputs))
    verdict = upload(browser, service.url, job_id, names[1], tokens[names[1]], targets)
    assert verdict.startswith(f"Accepted: {targets.name}"), verdict
    assert admin.status(job_id)["targets"][names[1]]["filled"]

    browser.get(f"{service.url}/#job/{job_id}")
    button = wait_for(browser, lambda d: by_id(d, "calibrate-now").is_enabled() and
                      by_id(d, "calibrate-now"), "Calibrate now")
    assert by_id(browser, "job").get_attribute("data-state") == "calibrating"
    rows = select_all(browser, "#statistics tbody tr")
    assert [r.get_attribute("class") for r in rows] == ["filled", "waiting"]
    assert hashlib.sha256(stats.read_bytes()).hexdigest() in rows[0].text
    rows = select_all(browser, "#targets tbody tr")
    assert [r.get_attribute("class") for r in rows] == ["waiting", "filled"]
    assert "round 1 of 1: statistics of the round's model (batch mode, every layer)" in \
        by_id(browser, "job").text
    shoot(browser, "job-calibrating")
    button.click()
    note = wait_for(browser, lambda d: by_id(d, "calibration").text, "the calibration report")
    assert note.startswith(f"Calibrated (one pass) with the statistics of {names[0]}: 64 "
                           f"inputs, batch mode; none from {names[1]}; targets of "
                           f"{names[1]}"), note
    assert by_id(browser, "job").get_attribute("data-state") == "succeeded"
    by_id(browser, "download").click()
    saved = browser.downloads / f"calibrated-{job_id}.safetensors"
    wait_for(browser, lambda d: saved.exists() and not list(
        browser.downloads.glob("*.crdownload")), "the calibrated model")
    assert saved.read_bytes() == admin.result(job_id, tmp_path / "c.safetensors").read_bytes()


def test_a_job_with_calibration_rounds_from_the_form(browser, service, admin):  # noqa: F811
    """The form's protocol and input moments reach the job; its page says the protocol."""
    sign_in(browser, service.url, ADMIN)
    wait_for(browser, lambda d: by_id(d, "nav").is_displayed(), "signed in")
    browser.get(service.url + "/#new")
    wait_for(browser, lambda d: by_id(d, "param-sweeps"), "the form")
    by_id(browser, "clients").send_keys("hospital-a, hospital-b")
    by_id(browser, "calibrate").click()
    by_id(browser, "protocol").send_keys("layerwise")
    by_id(browser, "input-moments").click()
    select_all(browser, "#create button[type=submit]")[0].click()
    wait_for(browser, lambda d: by_id(d, "tokens"), "the clients' tokens")
    job_id = re.fullmatch(r"Job ([0-9a-f]{32}) created", select_all(browser, "h2")[0].text)[1]
    job = admin.status(job_id)
    assert job["calibrate"] and job["protocol"] == "layerwise" and job["input_moments"]
    browser.get(f"{service.url}/#job/{job_id}")
    wait_for(browser, lambda d: "yes (layerwise)" in by_id(d, "job").text, "the protocol")


def test_a_transformer_jobs_model_downloads_with_its_config(
        browser, service, admin, tmp_path):  # noqa: F811
    """A job with a transformer's config: the upload page's download gives the round's
    weights and the config.json at the fused widths (what `fusekit` and Client give as a
    model folder), and says how they make one; the job page's download of the fused model
    gives both too."""
    import json

    from test_service_calibration import tiny_vit

    import fusekit

    names = ("hospital-a", "hospital-b")
    folders = [tiny_vit(tmp_path / name, seed=i) for i, name in enumerate(names)]
    spec = client_spec(fusekit.load_checkpoint(folders[0]), None).to_json()
    config = json.loads((folders[0] / "config.json").read_text())
    job = admin.create_job("pfnm", list(names), params={"width_ratio": 1.5}, spec=spec,
                           auto_run=True, calibrate=True, config=config)
    job_id = job["id"]
    for name, folder in zip(names, folders, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job_id, name, folder / "model.safetensors")
    assert admin.wait(job_id, timeout=120, every=0.1)["state"] == "calibrating"
    expected = admin.fused(job_id, tmp_path / "fused")  # the CLI's and Client's folder

    browser.get(f"{service.url}/upload?job={job_id}&client={names[0]}")
    assert not by_id(browser, "fetch-config").is_displayed()
    by_id(browser, "token").send_keys(job["tokens"][names[0]])
    offered(browser, "Download the fused model").click()
    weights = browser.downloads / f"round-1-{job_id}.safetensors"
    wait_for(browser, lambda d: weights.exists() and not list(
        browser.downloads.glob("*.crdownload")), "the round's model")
    wait_for(browser, lambda d: by_id(d, "fetch-config").is_displayed(), "its config button")
    verdict = by_id(browser, "verdict").text
    assert f"put {weights.name} and config-{job_id}.json into one folder as " \
           "model.safetensors and config.json" in verdict, verdict
    by_id(browser, "fetch-config").click()
    config_file = browser.downloads / f"config-{job_id}.json"
    wait_for(browser, lambda d: config_file.exists() and not list(
        browser.downloads.glob("*.crdownload")), "its config.json")
    assert weights.read_bytes() == (expected / "model.safetensors").read_bytes()
    assert config_file.read_bytes() == (expected / "config.json").read_bytes()
    assert json.loads(config_file.read_text())["intermediate_size"] > config["intermediate_size"]
    shoot(browser, "upload-transformer")
    folder = tmp_path / "downloaded"  # the two files make the model folder
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(weights.read_bytes())
    (folder / "config.json").write_bytes(config_file.read_bytes())
    assert fusekit.load_checkpoint(folder).content_hash == \
        fusekit.load_checkpoint(expected).content_hash
    config_file.unlink()

    sign_in(browser, service.url, ADMIN)
    wait_for(browser, lambda d: by_id(d, "nav").is_displayed(), "signed in")
    browser.get(f"{service.url}/#job/{job_id}")
    wait_for(browser, lambda d: by_id(d, "download-config").is_enabled() and
             by_id(d, "download-config"), "Download its config.json").click()
    wait_for(browser, lambda d: config_file.exists() and not list(
        browser.downloads.glob("*.crdownload")), "the fused model's config.json")
    assert config_file.read_bytes() == (expected / "config.json").read_bytes()
