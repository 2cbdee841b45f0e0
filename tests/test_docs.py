"""The documentation: README.md is a front page, the MkDocs site builds with ``--strict``,
and the examples the pages mark with ``<!-- run -->`` run as they stand.

A marked block is a fenced ``bash`` or ``python`` block right after the marker. A page's
marked blocks run in order (consecutive bash blocks in one shell, as a reader types them),
each in a process group of its own (ended when it returns), in one fresh folder per page,
with ``fusekit`` on PATH meaning this tree's command line (each command, and each python
block, forked from a warm process: :mod:`warm_fusekit`). The marker's option says what the
block needs:
``background`` runs it for the rest of the page (the service's server; the page's port 8420
becomes a free one), ``readme-clients`` starts the page in a folder holding the README's
simulated clients (``ckpts/``). Every path a bash block names with ``-o``/``--out`` must
exist once it has run. The first example of every page is marked, except on the pages named
in ``NOT_RUN``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from bench_service import http

from conftest import made_once
from warm_fusekit import WarmFusekit
from fusekit.toolkit.processes import end_groups

ROOT = Path(__file__).parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
MARKED = re.compile(r"^<!-- run(?:: ([\w-]+))? -->\n```(\w+)[^\n]*\n(.*?)^```$", re.M | re.S)
FENCED = re.compile(r"^```(bash|python)[^\n]*\n", re.M)
OUTPUT = re.compile(r"(?:^|\s)(?:-o|--out)\s+(\S+)")
SERVICE_PORT = "8420"
BLOCK_TIMEOUT = 300.0
NOT_RUN = {
    "ALGORITHMS.md": "the math, no example",
    "PARAMETERS.md": "generated from the declarations (tests/test_cli_methods.py)",
    "benchmarks.md": "make bench",
    "flower.md": "tests/test_flower_e2e.py runs its app's files on a real federation",
    "index.md": "the README's commands, run here from the README",
    "install.md": "installs from the network",
    "reference.md": "generated from the docstrings",
}


@dataclass(frozen=True)
class Block:
    needs: str  # "", "background" or "readme-clients"
    language: str
    code: str


def marked_blocks(page: Path) -> list[Block]:
    return [Block(needs or "", language, code)
            for needs, language, code in MARKED.findall(page.read_text())]


def shell_sessions(blocks: list[Block]) -> list[Block]:
    """Consecutive bash blocks joined into one: a reader types them into one shell, so a
    variable one sets ($JOB) is there for the next."""
    joined: list[Block] = []
    for block in blocks:
        previous = joined[-1] if joined else None
        if (previous and block.language == previous.language == "bash"
                and block.needs == previous.needs == ""):
            joined[-1] = Block("", "bash", previous.code + block.code)
        else:
            joined.append(block)
    return joined


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def environment(tmp_path_factory) -> Iterator[dict[str, str]]:
    """This tree's ``fusekit`` first on PATH (forked from a warm process: :mod:`warm_fusekit`),
    and no token from the caller's shell."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("FUSEKIT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    bin_dir = tmp_path_factory.mktemp("bin")
    warm = WarmFusekit(bin_dir).start(env)
    try:
        yield {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    finally:
        warm.stop()


def run_page(page: Path, folder: Path, env: dict[str, str]) -> None:
    blocks = marked_blocks(page)
    assert blocks, f"{page.name}: no block marked <!-- run -->"
    port = str(free_port())
    env = {**env, "FUSEKIT_SERVER": f"http://127.0.0.1:{port}"}
    background: list[subprocess.Popen] = []
    try:
        for number, block in enumerate(shell_sessions(blocks), 1):
            code = block.code.replace(SERVICE_PORT, port)
            where = f"{page.name}, marked block {number} (consecutive bash blocks as one)"
            if block.language == "bash":
                command = ["bash", "-euo", "pipefail", "-c", code]
            elif block.language == "python":
                script = folder.parent / f"{folder.name}-block-{number}.py"
                script.write_text(code)
                command = ["warm-python", str(script)]  # python FILE, forked warm
            else:
                raise AssertionError(f"{where}: a {block.language} block cannot run")
            if block.needs == "background":
                background.append(start_in_background(command, folder, env, where, port))
                continue
            run_block(command, folder, env, where, code)
            for output in outputs_named(code) if block.language == "bash" else ():
                assert (folder / output).exists(), f"{where}: {output} was not written"
    finally:
        end_groups(background)


def run_block(command: list[str], folder: Path, env: dict[str, str], where: str,
              code: str) -> None:
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        output = f"(still running after {BLOCK_TIMEOUT:.0f} s)"
    finally:
        end_groups([process])
    assert process.returncode == 0, (
        f"{where} exited with {process.returncode}:\n{code}\n--- output ---\n{output[-4000:]}")


def start_in_background(command: list[str], folder: Path, env: dict[str, str], where: str,
                        port: str, timeout: float = 120.0) -> subprocess.Popen:
    """The page's server, once it answers on its port."""
    log = open(folder.parent / f"{folder.name}-background.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if http("GET", f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    end_groups([process])
    raise AssertionError(f"{where}: nothing answered on port {port} "
                         f"(exit code {process.returncode}); see {log.name}")


def outputs_named(code: str) -> list[str]:
    lines = [line.split(" #")[0] for line in code.splitlines()
             if not line.lstrip().startswith("#")]
    return [match for line in lines for match in OUTPUT.findall(line)]


@pytest.fixture(scope="module")
def readme_folder(tmp_path_factory, environment) -> Path:
    """The README's commands run once for every worker (the pages that start from its
    clients copy them)."""
    with made_once(tmp_path_factory, "readme") as (folder, made):
        if not made:
            run_page(ROOT / "README.md", folder, environment)
    return folder


# The tests that run commands share one worker, so that one warm process serves them all.
runs_commands = pytest.mark.xdist_group("test_docs")


@runs_commands
def test_the_readme_first_fusion_runs(readme_folder):
    assert (readme_folder / "pfnm" / "recipe.yaml").is_file()
    assert (readme_folder / "nafi.safetensors").is_file()


@runs_commands
@pytest.mark.parametrize("page", [p.name for p in PAGES if marked_blocks(p)])
def test_marked_examples_run(page, tmp_path, environment, request):
    folder = tmp_path / "work"
    folder.mkdir()
    if any(block.needs == "readme-clients" for block in marked_blocks(ROOT / "docs" / page)):
        shutil.copytree(request.getfixturevalue("readme_folder") / "ckpts", folder / "ckpts")
    run_page(ROOT / "docs" / page, folder, environment)


@pytest.mark.parametrize("page", [p.name for p in PAGES if p.name not in NOT_RUN])
def test_every_page_marks_its_first_example(page):
    text = (ROOT / "docs" / page).read_text()
    first = FENCED.search(text)
    assert first, f"{page}: no bash or python example (or name it in NOT_RUN, with why)"
    assert re.search(r"<!-- run(?:: [\w-]+)? -->\n$", text[:first.start()]), (
        f"{page}: its first example (line {text[:first.start()].count(chr(10)) + 1}) is not "
        "marked <!-- run -->")


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    targets = re.findall(r"\]\(((?!https?:|#)[^)#]+)", readme)
    assert "docs/usage.md" in targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # The two commands CI runs on a fresh clone are the README's.
    assert "make demo\nmake test\n" in (ROOT / ".ci" / "run").read_text()


def test_the_site_builds_strictly_with_the_api_reference(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-4000:]
    reference = (site / "reference" / "index.html").read_text()
    assert "Fuse client checkpoints into one model" in reference  # fusekit.fuse's docstring
    assert "solve_assignment" in reference
    assert (site / "ALGORITHMS" / "index.html").is_file()
