"""Ctrl-C stops the whole test run, subprocesses included (``process_tree``, installed by conftest.py): SIGINT to
a process running a test's ``subprocess.run`` leaves nothing it started running, a worker torchrun-style in a session
of its own included."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import process_tree

TESTS = os.path.dirname(os.path.abspath(__file__))
# a test's process (``install``: what conftest.py does) waiting in subprocess.run on a launcher that starts a worker
# in its own session, as torchrun starts each worker
RUNNER = """
import signal, subprocess, sys
import process_tree
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground run, even if this one ignores SIGINT
if sys.argv[2] == "install":
    process_tree.install()
subprocess.run([sys.executable, "-c", sys.argv[3], sys.argv[1]], capture_output=True, timeout=600)
"""
LAUNCHER = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {worker.pid}")
time.sleep(600)
"""


def interrupted_run(tmp_path, install: bool) -> tuple[subprocess.Popen, list[int]]:
    """The runner after a SIGINT sent to it alone, and the (launcher, worker) ids it had started."""
    pids = tmp_path / "pids"
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(pids), "install" if install else "no", LAUNCHER], cwd=TESTS,
        env=dict(os.environ, PYTHONPATH=TESTS), start_new_session=True)  # the signal reaches nothing else
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert runner.poll() is None and time.monotonic() < deadline, "the launcher did not start its worker"
        time.sleep(0.05)
    started = [int(p) for p in pids.read_text().split()]
    runner.send_signal(signal.SIGINT)
    runner.wait(timeout=30)
    return runner, started


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The ids still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(process_tree.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if process_tree.alive(p)]


def test_sigint_stops_every_process_a_test_started(tmp_path):
    runner, started = interrupted_run(tmp_path, install=True)
    assert runner.returncode == -signal.SIGINT  # interrupted as Python's own handler interrupts
    assert gone_within(started, 1.0) == []


def test_without_it_a_worker_in_its_own_session_outlives_the_run(tmp_path):
    """What conftest.py's handler prevents: subprocess.run kills its child only."""
    runner, (launcher, worker) = interrupted_run(tmp_path, install=False)
    try:
        assert runner.returncode == -signal.SIGINT
        assert gone_within([launcher], 5.0) == [] and process_tree.alive(worker)
    finally:
        if process_tree.alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_conftest_installs_it():
    handler = signal.getsignal(signal.SIGINT)
    # a run started with SIGINT ignored (a background job) keeps ignoring it
    assert handler is process_tree.on_interrupt or handler is signal.SIG_IGN
