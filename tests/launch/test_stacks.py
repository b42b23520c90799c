"""Reading a process's state and Python stack from outside (launch/stacks.py), also while stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_ft.launch import stacks

SCRIPT = ("import time\ndef parked_here():\n    print('up', flush=True)\n    while True:\n        time.sleep(0.01)\n"
          "parked_here()\n")


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    yield p
    if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(10)


@pytest.mark.skipif(not stacks.py_spy(), reason="py-spy is not installed")
def test_a_stopped_process_has_state_T_and_its_stack_is_read_while_it_stays_stopped(child):
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while stacks.process_state(child.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stacks.process_state(child.pid) == "T"
    text = stacks.dump_stack(child.pid)
    assert f"Process {child.pid}" in text and "parked_here (<string>:" in text, text
    assert stacks.process_state(child.pid) == "T"  # still stopped: the dump did not resume it


def test_without_py_spy_the_stack_says_how_to_get_it(child, monkeypatch):
    monkeypatch.setattr(stacks, "py_spy", lambda: "")
    assert stacks.dump_stack(child.pid).startswith("no stack: py-spy is not installed (pip install py-spy")


def test_a_gone_process_has_an_unknown_state_and_a_failed_dump_says_why(child):
    child.kill()
    child.wait(10)
    assert stacks.process_state(child.pid) == "?"
    if stacks.py_spy():
        assert stacks.dump_stack(child.pid).startswith(f"no stack: py-spy dump --pid {child.pid} failed")
