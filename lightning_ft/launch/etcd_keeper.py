"""The launcher's side of etcd (docs/GUIDE.md, "etcd"; docs/ARCHITECTURE.md, "Launch and
supervision"): what `lightning-ft run` does about it.

- Without an endpoint it starts an embedded cluster of `etcd.members` members on loopback
  (1 by default; 3 survive the loss of any one) and brings back a member that dies: with
  peers it is replaced by an empty member that rejoins (`EtcdCluster.heal_dead`), a lone one
  restarts on its data.
- It builds the supervisor's store from the job's `etcd` config (TLS, auth, connect timeout)
  and gives the replicas what they need to build theirs (LFT_ETCD, LFT_ETCD_PASSWORD).
- It notices an outage longer than `etcd.connect_timeout_s`. The replicas ride out a shorter
  one (every request retries that long); after a longer one they exit, and restarting them
  cannot help until etcd is back. So the launcher stops the job with a clear error that names
  the newest checkpoint and the command that resumes from it.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

from lightning_ft.coord.etcd_server import EtcdCluster
from lightning_ft.coord.etcd_config import PASSWORD_ENV, REDACTED, config_endpoints, store_from_config
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import StoreError
from lightning_ft.threads import Thread

PROBE_INTERVAL_S = 2.0


class EtcdKeeper:
    """Owns the job's etcd connection for one launcher; `tick()` from the supervision loop.

    Threads: the launcher's main thread (start, tick, close); the probe thread
    (`lft-etcd-probe`) writes only `_last_ok` (a float replaced whole; tick reads it); the heal
    thread (`lft-etcd-heal`) writes only `_heal_failure` (a string set once; `lost` reads it)
    and the cluster's members, under `_heal_lock`, which close() takes to end it."""

    def __init__(self, cfg: Any, say: Callable[[str], None] = print) -> None:
        self.cfg = cfg.etcd
        self._say = say
        self.cluster: Optional[EtcdCluster] = None
        self.endpoint = ",".join(config_endpoints(self.cfg))
        self.store: Optional[EtcdStore] = None
        self._probe: Optional[EtcdStore] = None
        self._last_ok = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._healer: Optional[threading.Thread] = None
        self._heal_lock = threading.Lock()
        """Held by the heal thread for each pass, and by close(): no heal runs once it closed."""
        self._closing = False
        self._outage: Optional[str] = None
        """etcd unreachable too long (the main thread's `tick` writes it)."""
        self._heal_failure: Optional[str] = None
        """An embedded member in a crash loop (the heal thread writes it)."""

    @property
    def lost(self) -> Optional[str]:
        """Why the job must stop (etcd unreachable too long, a member in a crash loop), or None."""
        return self._heal_failure or self._outage

    @property
    def embedded(self) -> bool:
        return self.cluster is not None

    def start(self) -> str:
        """Start the embedded cluster if there is no endpoint, connect, start the probe; the
        endpoints. Raises EtcdNotFound / RuntimeError (embedded etcd) or StoreError."""
        if not self.endpoint:
            self.cluster = EtcdCluster(int(self.cfg.members)).start()
            self.endpoint = self.cluster.endpoint
        try:
            self.store = store_from_config(self.cfg, self.endpoint)
            self._probe = store_from_config(self.cfg, self.endpoint, connect_timeout_s=1.0)
        except BaseException:
            self.close()
            raise
        self._thread = Thread(target=self._probe_loop, name="lft-etcd-probe", daemon=True)
        self._thread.start()
        if self.cluster is not None:
            self._healer = Thread(target=self._heal_loop, args=(self.cluster,), name="lft-etcd-heal", daemon=True)
            self._healer.start()
        return self.endpoint

    def describe(self) -> str:
        if self.cluster is None:
            return f"etcd {self.endpoint}"
        n = len(self.cluster.servers)
        return f"etcd {self.endpoint} (embedded{f', {n} members' if n > 1 else ''})"

    def child_env(self) -> dict[str, str]:
        """What replicas need beyond LFT_ETCD: the password, if the config holds it."""
        pw = str(self.cfg.password or "")
        return {PASSWORD_ENV: pw} if pw and pw != REDACTED else {}

    def _probe_loop(self) -> None:
        probe = self._probe
        assert probe is not None  # the loop starts after the probe store is made
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                probe.revision()
                self._last_ok = time.monotonic()
            except StoreError:
                pass

    def _heal_loop(self, c: EtcdCluster) -> None:
        """Bring dead embedded members back (`EtcdCluster.heal_dead`), off the supervision loop:
        replacing a member takes etcd a second or more. This thread lives as long as the
        cluster, as the members it starts must (they die with the thread that started them).
        A crash loop stops the job (`lost`)."""
        how = c.heal_verb
        while not self._stop.wait(0.2):
            with self._heal_lock:
                if self._closing:
                    return
                try:
                    for i, code in c.heal_dead():
                        self._say(f"lightning-ft: etcd member {c.servers[i].name} exited (code {code}); {how}")
                except RuntimeError as e:
                    self._heal_failure = str(e)
                    return

    def tick(self) -> bool:
        """True when the job must stop (see `lost`); dead embedded members are brought back by
        the heal thread."""
        if self.lost is not None:
            return True
        down = time.monotonic() - self._last_ok
        limit = float(self.cfg.connect_timeout_s) + 1.0
        if down > limit:
            self._outage = (f"etcd at {self.endpoint} has been unreachable for {down:.1f}s, longer than "
                            f"etcd.connect_timeout_s={float(self.cfg.connect_timeout_s):g}")
        return self.lost is not None

    def lost_message(self, checkpoint_root: str, run_dir: str) -> str:
        """The error to print after the job was stopped for `lost`: the newest checkpoint, how to resume."""
        from lightning_ft.replica.checkpoint import newest_valid

        found = newest_valid(checkpoint_root, warn=lambda m: None) if os.path.isdir(checkpoint_root) else None
        where = (f"the newest checkpoint that verifies is {found[1]} (step {found[0]}); once etcd is back, "
                 f"resume with `lightning-ft run --resume {run_dir} ...`" if found else
                 f"no checkpoint that verifies under {checkpoint_root} (checkpoint.every_n_steps)")
        return f"lightning-ft run: {self.lost}: stopped the job; {where}"

    def close(self) -> None:
        with self._heal_lock:  # no heal in flight, and none after: then the members stop, and
            self._closing = True  # only then the healer (the members it started die with it)
            if self.cluster is not None:
                self.cluster.cleanup()
        self._stop.set()
        for s in (self._probe, self.store):
            if s is not None:
                s.close()
