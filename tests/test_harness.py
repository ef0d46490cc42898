"""The test harness's own promise: a job that outlives its limit fails the test and leaves no
process behind (the launcher's ranks are killed with it, not left holding ports and cores)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from conftest import run_cmd


def test_a_job_past_its_limit_fails_the_test_and_its_ranks_are_killed_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    # a "launcher" that starts a "rank" and waits for it, as mpirun and torchrun do
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); child.wait()")
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="job timed out after 3s"):
        run_cmd([sys.executable, "-c", script], timeout_s=3)
    assert time.monotonic() - t0 < 60
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered; the zombie is reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"the rank (pid {child}) outlived its job's timeout")
