"""The supervisor's event log (launch/event_log.py): the loop and the hang-diagnosis threads
write it at once; every line stays whole, and the status table reads each replica's last event."""
from __future__ import annotations

import json
import threading

from lightning_ft.launch.event_log import EventLog


def test_events_are_json_lines_and_the_last_event_carries_its_reason(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"))
    log.replica(1, 0, "start", pids=[11], master_port=2900)
    log.replica(1, 0, "hang", reason="rank 0 stopped (T)", diagnosis=True)
    log.line({"event": "spare_start", "token": "t1"})
    assert log.last(1) == "hang: rank 0 stopped (T)" and log.last(2) == ""
    log.close()
    log.line({"event": "spare_stop"})  # after close: dropped, not an error
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("replica"), r.get("incarnation")) for r in rows] == [
        ("start", 1, 0), ("hang", 1, 0), ("spare_start", None, None)]
    assert rows[0]["pids"] == [11] and rows[1]["diagnosis"] is True


def test_writes_from_several_threads_stay_whole(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"))

    def write(rid: int) -> None:
        for i in range(300):
            log.replica(rid, i, "exit", stacks={"0": "x" * 2000})

    threads = [threading.Thread(target=write, args=(rid,)) for rid in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert len(rows) == 1200
    assert {rid: [r["incarnation"] for r in rows if r["replica"] == rid] for rid in range(4)} == {
        rid: list(range(300)) for rid in range(4)}
