"""A tiny supervised process for tests/launch/test_supervisor.py (no torch, so it starts fast).

    child.py OUT_DIR [WHO=ACTION ...]

It writes its environment to OUT_DIR/r{rid}.i{inc}.rank{rank}.env.json, then does the ACTION
of the first WHO that matches it (default `sleep`). WHO is `RID:INC:RANK`, each field a number
or `*`. ACTIONs:

    exit:CODE:MS            sleep MS ms, write the time to OUT_DIR/...exit, exit with CODE
    sleep                   sleep until killed
    ignore_term             ignore SIGTERM, start a grandchild `sleep` (pid in OUT_DIR/...grandchild), sleep
    halt:MS                 sleep MS ms, write the run's `halt` key (the job halted), exit 86
    member:HOLD_MS:THEN:RATE
                            put the run's members/{rid} bound to a 1 s lease, reporting step
                            RATE * seconds so far; keep it alive for HOLD_MS ms (-1: forever), then
                            THEN = `hang` (stop the keepalive, sleep) or `revoke` (revoke, exit 0 after 0.3 s)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    out_dir, specs = sys.argv[1], sys.argv[2:]
    rid, inc, rank = (int(os.environ[k]) for k in ("LFT_REPLICA_ID", "LFT_INCARNATION", "RANK"))
    tag = os.path.join(out_dir, f"r{rid}.i{inc}.rank{rank}")
    _write(tag + ".env.json", json.dumps(dict(os.environ)))
    action = _action(specs, (rid, inc, rank)).split(":")
    if action[0] == "exit":
        time.sleep(int(action[2]) / 1000)
        _write(tag + ".exit", repr(time.time()))
        os._exit(int(action[1]))
    if action[0] == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen(["sleep", "1000"])
        _write(tag + ".grandchild", str(grandchild.pid))
    if action[0] == "halt":
        _halt(int(action[1]))
    if action[0] == "member":
        _member(rid, inc, int(action[1]), action[2], float(action[3]))
    while True:
        time.sleep(1000)


def _action(specs: list[str], me: tuple[int, int, int]) -> str:
    for spec in specs:
        who, action = spec.split("=", 1)
        if all(f == "*" or int(f) == v for f, v in zip(who.split(":"), me, strict=True)):
            return action
    return "sleep"


def _member(rid: int, inc: int, hold_ms: int, then: str, rate: float) -> None:
    from lightning_ft.coord.etcd_store import EtcdStore

    store = EtcdStore(os.environ["LFT_ETCD"], connect_timeout_s=5)
    from lightning_ft.coord import keys

    key = keys.members(keys.root("/lft", os.environ["LFT_JOB"], os.environ.get("LFT_RUN_ID", "")), rid)
    lease = store.lease_grant(1)
    t0 = time.monotonic()
    while hold_ms < 0 or time.monotonic() - t0 < hold_ms / 1000:
        step = int(rate * (time.monotonic() - t0))
        store.put(key, json.dumps({"rid": rid, "incarnation": inc, "step": step, "round": 0}).encode(), lease=lease)
        store.lease_keepalive(lease)
        time.sleep(0.1)
    if then == "revoke":
        store.lease_revoke(lease)
        time.sleep(0.3)
        os._exit(0)


def _halt(ms: int) -> None:
    from lightning_ft.coord import keys
    from lightning_ft.coord.etcd_store import EtcdStore

    time.sleep(ms / 1000)
    store = EtcdStore(os.environ["LFT_ETCD"], connect_timeout_s=5)
    root = keys.root("/lft", os.environ["LFT_JOB"], os.environ.get("LFT_RUN_ID", ""))
    store.put(keys.halt(root), json.dumps({"reason": "replica states diverged (test)"}).encode())
    os._exit(86)


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
