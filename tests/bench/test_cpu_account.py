"""bench/cpu_account.py: a process is counted under the role of what it runs now."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time

from lightning_ft.bench.cpu_account import Account


def test_a_child_sampled_before_its_exec_is_counted_as_what_it_became(tmp_path):
    """CI: the overhead bench's embedded etcd, first seen between the launcher's fork and the
    exec (its command line still the launcher's), was counted as the launcher for good."""
    etcd = tmp_path / "etcd"  # a command whose name says etcd
    etcd.symlink_to(shutil.which("sleep"))
    child = subprocess.Popen([sys.executable, "-c",
                              f"import os, time; time.sleep(0.5); os.execv({str(etcd)!r}, [{str(etcd)!r}, '30'])"])
    try:
        acc = Account(child.pid)
        acc._sample()
        assert set(acc.totals()["by_role"]) == {"worker"}  # python, before the exec
        deadline = time.monotonic() + 20
        while not open(f"/proc/{child.pid}/cmdline").read().startswith(str(etcd)):
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.05)
        acc._sample()
        assert set(acc.totals()["by_role"]) == {"etcd"}
    finally:
        child.kill()
        child.wait(10)
