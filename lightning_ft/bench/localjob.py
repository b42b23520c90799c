"""Launch replicas of examples/plain_loop.py locally, as real processes, for tests and benchmarks.

It plays the supervisor's part by hand, so that tests control exactly when a replica is
killed, stopped, evicted and restarted. Every process is tracked by PID and killed at close.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import IO, Callable, Optional

from lightning_ft.coord import keys, standby
from lightning_ft.coord.etcd_server import free_port
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.jsonlines import JsonLines
from lightning_ft.launch.zygote import Proc, Zygote, default_preload, python_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo checkout
LOOP = os.path.join(ROOT, "examples", "plain_loop.py")
TEST_SECRET = "localjob-test-secret-0123456789"


def log_tails(log_dir: str, lines: int = 15) -> str:
    """The last `lines` lines of every log of the job: why an intermittent wait timed out, after
    the job's temporary directory is gone."""
    out = []
    try:
        names = sorted(os.listdir(log_dir))
    except OSError:
        return ""
    for name in names:
        try:
            with open(os.path.join(log_dir, name), errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            continue
        out.append(f"--- {name}\n" + "".join(tail))
    return "\n".join(out)


class Replica:
    def __init__(self, job: "Job", rid: int, inc: int, standby: str = "", spare_env: Optional[dict] = None,
                 zygote: Optional[Zygote] = None) -> None:
        """Replica `rid`'s incarnation `inc`, or (`standby`) a warm spare with that token and
        `spare_env` (rid and inc are -1 until `Job.promote`); forked by `zygote` (launch/zygote.py)
        when one is given and ready, else started as new processes."""
        self.rid, self.inc, self.standby = rid, inc, standby
        self.log_dir = job.log_dir
        self.procs: list[Proc] = []
        stdout: Optional[IO[str]] = None
        port = free_port()
        who = {"LFT_STANDBY": standby} if standby else {"LFT_REPLICA_ID": str(rid), "LFT_INCARNATION": str(inc)}
        extra_env = spare_env if standby else job.env.get((rid, inc), {})
        for rank in range(job.world):
            env = {**os.environ, "LFT_JOB": job.name, **who, "LFT_NUM_REPLICAS": str(job.R),
                   "LFT_ETCD": job.etcd, "LFT_SECRET": TEST_SECRET, "LFT_RUN_ID": job.run_id,
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job.world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   **(extra_env or {})}
            name = f"spare-{standby}" if standby else f"r{rid}.i{inc}"
            log = open(os.path.join(job.log_dir, f"{name}.rank{rank}.log"), "w")
            env["LFT_SPAWN_T"] = repr(time.time())  # the restart breakdown's zero (replica/startup.py)
            args = [] if standby else job.extra.get((rid, inc), [])
            cmd = [sys.executable, LOOP, *job.args, *args]
            if zygote is not None:
                r, w = os.pipe() if rank == 0 else (-1, log.fileno())
                forked = zygote.spawn(cmd, env, os.getcwd(), w, log.fileno())
                if rank == 0:
                    os.close(w)
                    if forked is not None:
                        stdout = os.fdopen(r, "r")
                    else:
                        os.close(r)
                if forked is not None:
                    self.procs.append(forked)
                    continue
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if rank == 0 else log, stderr=log, text=True)
            if rank == 0:
                stdout = p.stdout
            self.procs.append(p)
        assert stdout is not None  # rank 0 writes into a pipe
        self.out = JsonLines(stdout)

    @property
    def rows(self) -> list[dict]:
        return self.out.rows

    def steps(self, event: str = "step") -> list[dict]:
        return self.out.select(lambda r: r.get("event") == event)

    def wait_for(self, pred: Callable[[dict], bool], timeout_s: float) -> dict:
        row = self.out.wait_for(pred, timeout_s)
        if row is None:
            raise AssertionError(f"replica {self.rid}.{self.inc} never matched; exit codes "
                                 f"{[p.poll() for p in self.procs]}; last rows {self.rows[-3:]}\n"
                                 + log_tails(self.log_dir))
        return row

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


class Job:
    """R replicas x W ranks of the plain loop against one etcd."""

    def __init__(self, etcd: str, tmp: str, R: int = 3, world: int = 1, args: tuple[str, ...] = (),
                 extra: Optional[dict] = None, env: Optional[dict] = None, zygote: Optional[Zygote] = None) -> None:
        """`extra[(rid, inc)]`: more arguments for that incarnation; `env[(rid, inc)]`: more
        environment (e.g. another LFT_SECRET); `zygote`: a ready zygote that replicas are forked
        from unless `start(..., forked=False)` (as `lightning-ft run` does; the caller owns it)."""
        self.etcd, self.R, self.world = etcd, R, world
        self.name = "t" + uuid.uuid4().hex[:8]
        self.args = list(args)
        self.extra = extra or {}
        self.env = env or {}
        self.log_dir = str(tmp)
        self.replicas: dict[int, Replica] = {}
        self.spares: dict[str, Replica] = {}
        self.history: list[Replica] = []
        self.store = EtcdStore(etcd)
        self.run_id = "run0"
        self.root = keys.root("/lft", self.name, self.run_id)
        self.zygote: Optional[Zygote] = zygote
        self._own_zygote = False

    def open_zygote(self, timeout_s: float) -> float:
        """Start a zygote (launch/zygote.py) that has imported what `lightning-ft run`'s would for
        the plain loop (`default_preload`), for `start(..., forked=True)`; returns the seconds
        its imports took."""
        self.zygote = Zygote(default_preload(python_target([sys.executable, LOOP])),
                             log_path=os.path.join(self.log_dir, "zygote.log"))
        self._own_zygote = True
        assert self.zygote.ready.wait(timeout_s), f"the zygote was not ready within {timeout_s}s; see {self.log_dir}"
        return float(self.zygote.preloaded_s or 0.0)

    def start(self, rid: int, inc: int = 0, forked: Optional[bool] = None) -> Replica:
        """Replica `rid`'s incarnation `inc`; `forked`: from the zygote (`open_zygote` first, or
        one given to the job); None: forked when the job has a ready zygote, else new processes."""
        assert not forked or self.zygote is not None, "open_zygote() first"
        if forked is None:
            forked = self.zygote is not None and self.zygote.ready.is_set()
        r = Replica(self, rid, inc, zygote=self.zygote if forked else None)
        self.replicas[rid] = r
        self.history.append(r)
        return r

    def start_spare(self, token: str, env: Optional[dict] = None) -> Replica:
        """A warm spare (coord/standby.py): it starts up and waits, registered, until promoted;
        forked from the job's zygote when that is ready, as `lightning-ft run` starts spares."""
        ready = self.zygote is not None and self.zygote.ready.is_set()
        r = Replica(self, -1, -1, standby=token, spare_env=env, zygote=self.zygote if ready else None)
        self.spares[token] = r
        self.history.append(r)
        return r

    def wait_spare(self, token: str, timeout_s: float) -> None:
        """Until spare `token` is registered (warm) in etcd."""
        deadline = time.monotonic() + timeout_s
        while self.store.get(keys.standby(self.root, token)) is None:
            assert self.spares[token].alive(), f"spare {token} exited; see {self.log_dir}"
            assert time.monotonic() < deadline, f"spare {token} did not register within {timeout_s}s"
            time.sleep(0.02)

    def promote(self, token: str, rid: int) -> Replica:
        """Spare `token` becomes replica `rid`'s next incarnation (the test plays the supervisor)."""
        inc = self.replicas[rid].inc + 1 if rid in self.replicas else 0
        assert standby.promote(self.store, self.root, token, rid, inc), f"spare {token} is gone"
        r = self.spares.pop(token)
        r.rid, r.inc = rid, inc
        self.replicas[rid] = r
        return r

    def start_all(self) -> None:
        for rid in range(self.R):
            self.start(rid)

    def evict(self, rid: int, reason: str = "killed by test") -> float:
        t = time.time()
        self.store.put(keys.evict(self.root, rid, self.replicas[rid].inc), reason.encode())
        return t

    def wait_exit(self, rid: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.replicas[rid].alive():
            assert time.monotonic() < deadline, f"replica {rid} did not exit"
            time.sleep(0.005)

    def wait_done(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for r in self.replicas.values():
            for p in r.procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"replica {r.rid} did not finish; last rows {r.rows[-3:]}") from None
                assert p.returncode == 0, f"replica {r.rid} rank exited {p.returncode}; see {self.log_dir}"

    def finals(self) -> dict[int, list[str]]:
        return {rid: r.wait_for(lambda x: x.get("event") == "final", 5)["digest"] for rid, r in self.replicas.items()}

    def close(self) -> None:
        for r in self.history:
            r.kill()
        if self.zygote is not None and self._own_zygote:
            self.zygote.close()
        self.store.close()
