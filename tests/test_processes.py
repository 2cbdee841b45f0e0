"""Process-group helpers: what a local federation or server leaves behind is found and ended,
including a process whose parent ended first (re-parented, in a session of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from fusekit.toolkit.processes import end_groups, group_alive, groups_with_env, process_alive

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def test_an_orphan_in_its_own_session_is_found_by_its_environment_and_ended():
    mark = uuid.uuid4().hex
    env = {**os.environ, "FUSEKIT_TEST_MARK": mark}
    # The parent starts a child in a session of its own and exits at once, as the SuperLink
    # leaves its SuperExec when it ends before it.
    subprocess.run([sys.executable, "-c",
                    "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(60)'], start_new_session=True, "
                    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"],
                   env=env, check=True, timeout=30)
    deadline = time.monotonic() + 10
    while not (groups := groups_with_env("FUSEKIT_TEST_MARK", mark)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert os.getpgrp() not in groups and len(groups) == 1
    end_groups([], grace=5, also=groups)
    assert not any(group_alive(group) for group in groups)
    assert groups_with_env("FUSEKIT_TEST_MARK", mark) == set()
    assert groups_with_env("FUSEKIT_TEST_MARK", "no-such-value") == set()


def test_a_process_and_its_group_are_alive_until_ended():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    try:
        assert process_alive(process.pid) and group_alive(process.pid)
    finally:
        end_groups([process], grace=5)
    assert not process_alive(process.pid) and not group_alive(process.pid)
    assert process_alive(os.getpid())
