"""`lightning-ft report` on a synthetic run whose downtime and step rate are known exactly:
the summary numbers, and that timeline.png shows each replica's states where they were."""
from __future__ import annotations

import json
import os

import pytest

from lightning_ft import report

T0 = 1_000_000.0
STEP = 0.5  # fault-free seconds per step


def write_run(d, replicas=3, steps=60, kill=(1, 20), back_after_s=6.0):
    """Replica `kill[0]` dies at step kill[1]; it is back (catch-up row) `back_after_s` later."""
    os.makedirs(d, exist_ok=True)
    rid_k, step_k = kill
    t_kill = T0 + 2.0 + step_k * STEP
    events = [{"t": T0, "event": "start", "replica": r, "incarnation": 0} for r in range(replicas)]
    events += [{"t": t_kill, "event": "exit", "replica": rid_k, "incarnation": 0, "code": -9},
               {"t": t_kill + 0.01, "event": "evict", "replica": rid_k, "incarnation": 0,
                "reason": "rank 0 exited with -9"},
               {"t": t_kill + 0.5, "event": "restart", "replica": rid_k, "incarnation": 1}]
    for r in range(replicas):
        events.append({"t": T0 + 2.0 + steps * STEP + 0.2, "event": "exit", "replica": r,
                       "incarnation": 1 if r == rid_k else 0, "code": 0})
    with open(os.path.join(d, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    t_back = t_kill + back_after_s
    for r in range(replicas):
        rows = []
        for s in range(1, steps + 1):
            t = T0 + 2.0 + s * STEP
            down = r == rid_k and t_kill <= t < t_back
            if down:
                continue
            healthy = [x for x in range(replicas) if not (x == rid_k and t_kill <= t < t_back + STEP)]
            inc = 1 if (r == rid_k and t >= t_back) else 0
            first_back = r == rid_k and inc == 1 and not any(x["inc"] == 1 for x in rows)
            rows.append({"t": t, "rid": r, "inc": inc, "step": s, "loss": 5.0 - s * 0.01, "contributors": healthy,
                         "epoch": 0, "lr_factor": 1.0, "caught_up": first_back, "call_s": 0.3 if first_back else STEP,
                         "exchange_ms": 1.0, "catchup_ms": 0.0, "retries": 0})
        os.makedirs(os.path.join(d, f"replica_{r}"), exist_ok=True)
        with open(os.path.join(d, f"replica_{r}", "steps.jsonl"), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in rows)
        with open(os.path.join(d, f"replica_{r}", "final.json"), "w") as f:
            json.dump({"rid": r, "step": steps, "digest": ["abc"]}, f)
    return t_kill, t_back


def test_summary_numbers(tmp_path):
    t_kill, t_back = write_run(str(tmp_path))
    s = report.report(str(tmp_path), png=False)
    assert s["replicas"] == 3 and s["steps"] == 60 and s["restarts"] == 1 and s["identical"] is True
    assert s["fault_free_step_s"] == pytest.approx(STEP)
    # steps were never delayed, but the 13 steps from the kill until replica 1 contributed
    # again (t_kill .. t_back + STEP) trained 2 of 3 slot batches: ETT counts work
    assert s["work_steps"] == pytest.approx(60 - 13 / 3, abs=1e-3)
    assert s["ett"] == pytest.approx((60 - 13 / 3) / 60, abs=1e-4)
    [f] = s["failures"]
    assert f["replica"] == 1 and f["down_s"] == pytest.approx(6.0 - 0.0, abs=STEP) and f["healthy_stall_s"] == 0
    assert (tmp_path / "summary.md").read_text().count("| 1 | 0 | rank 0 exited with -9 |") == 1


def test_summary_sees_a_stall(tmp_path):
    write_run(str(tmp_path))
    for rid in (0, 1, 2):  # the job waits 3 s right after the failure
        q = tmp_path / f"replica_{rid}" / "steps.jsonl"
        rr = [json.loads(l) for l in open(q)]
        for r in rr:
            if r["step"] > 20:
                r["t"] += 3.0
        q.write_text("".join(json.dumps(r) + "\n" for r in rr))
    s = report.report(str(tmp_path), png=False)
    assert s["failures"][0]["healthy_stall_s"] == pytest.approx(3.0, abs=0.01)
    assert s["ett"] < 0.95


def write_steps(d, rows_by_rid, events=()):
    """A run directory from explicit steps.jsonl rows: {rid: [(t, step, contributors, inc)]}."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    for rid, rows in rows_by_rid.items():
        os.makedirs(os.path.join(d, f"replica_{rid}"), exist_ok=True)
        with open(os.path.join(d, f"replica_{rid}", "steps.jsonl"), "w") as f:
            for t, step, contributors, inc in rows:
                f.write(json.dumps({"t": t, "rid": rid, "inc": inc, "step": step, "loss": 1.0,
                                    "contributors": contributors, "caught_up": False, "call_s": STEP}) + "\n")


def test_ett_counts_work_not_steps_when_the_survivor_steps_faster(tmp_path):
    # 2 replicas; replica 1 is away for steps 21..40 and replica 0 alone steps 1.5x faster
    # (no exchange, a core to itself). Counting steps gave 60 x 0.5 / 26.67 = 1.125.
    rows, t = [], T0
    for step in range(1, 61):
        t += STEP if not 21 <= step <= 40 else STEP / 1.5
        rows.append((t, step, [0] if 21 <= step <= 40 else [0, 1], 0))
    back = [(t, s, c, 1 if s > 40 else 0) for t, s, c, _ in rows if not 21 <= s <= 40]
    write_steps(str(tmp_path), {0: rows, 1: back})
    s = report.summarize(report.load(str(tmp_path)))
    wall = rows[-1][0] - rows[0][0] + STEP
    assert s["work_steps"] == pytest.approx(40 + 20 / 2)
    assert s["ett"] == pytest.approx(50 * STEP / wall, abs=1e-4)
    assert s["ett"] < 1.0 < 60 * STEP / wall


def test_ett_counts_a_step_redone_after_a_rollback_once(tmp_path):
    # restart-the-world: steps 41..50 were trained, lost, and trained again after a restart
    first = [(T0 + i * STEP, i, [0, 1], 0) for i in range(1, 51)]
    again = [(T0 + 60 + i * STEP, i, [0, 1], 1) for i in range(41, 61)]
    write_steps(str(tmp_path), {0: first + again, 1: first + again})
    s = report.summarize(report.load(str(tmp_path)))
    assert s["steps"] == 60 and s["work_steps"] == pytest.approx(60)
    wall = again[-1][0] - first[0][0] + STEP
    assert s["ett"] == pytest.approx(60 * STEP / wall, abs=1e-4)


def test_a_rewind_is_reported_and_its_lost_steps_count_as_lost(tmp_path):
    # every replica died at step 45; the job rewound to the step-40 checkpoint and trained 41..60 again
    first = [(T0 + i * STEP, i, [0, 1], 0) for i in range(1, 46)]
    again = [(T0 + 60 + i * STEP, i, [0, 1], 1) for i in range(41, 61)]
    rewind = {"t": T0 + 59, "event": "rewind", "replica": 0, "incarnation": 1, "from": 45, "to": 40,
              "checkpoint": "/ck/step_00000040", "gen": 1}
    write_steps(str(tmp_path), {0: first + again, 1: first + again}, events=[rewind])
    s = report.summarize(report.load(str(tmp_path)))
    assert s["rewinds"] == [{"from": 45, "to": 40, "checkpoint": "/ck/step_00000040", "lost_steps": 5}]
    assert s["work_steps"] == pytest.approx(60)  # 41..45 count once, although trained twice
    md = report.markdown(s)
    assert "## Rewinds" in md and "| 45 | 40 | /ck/step_00000040 | 5 |" in md


def test_a_straggler_is_reported_with_its_ratio_window_and_bench(tmp_path):
    rows = [(T0 + i * STEP, i, [0, 1, 2], 0) for i in range(1, 31)]
    ev = {"t": T0 + 10, "event": "straggler", "replica": 2, "incarnation": 0, "by": 0, "ratio": 2.917, "window": 10,
          "threshold": 1.3, "policy": "exclude", "step": 19, "round": 20, "benched": True, "exclusions": 1}
    back = {"t": T0 + 22.5, "event": "readmitted", "replica": 2, "incarnation": 0, "by": 0, "round": 90, "step": 88,
            "exclusions": 1, "probe_ratio": 1.1}
    write_steps(str(tmp_path), {0: rows, 1: rows, 2: rows}, events=[ev, back])
    s = report.summarize(report.load(str(tmp_path)))
    assert s["stragglers"] == [{"replica": 2, "step": 19, "ratio": 2.917, "window": 10, "policy": "exclude",
                                "benched": 1, "out_s": 12.5, "kept": None}]
    md = report.markdown(s)
    assert "## Stragglers" in md and "| 2 | 19 | 2.917 | 10 | exclude | 1 | 12.5 | - |" in md
    shrunk = {**ev, "policy": "shrink", "gives": 2, "of": 4}
    del shrunk["benched"], shrunk["exclusions"]
    write_steps(str(tmp_path / "s"), {0: rows, 1: rows, 2: rows}, events=[shrunk])
    md = report.markdown(report.summarize(report.load(str(tmp_path / "s"))))
    assert "| 2 | 19 | 2.917 | 10 | shrink | - | - | 2/4 |" in md
    write_steps(str(tmp_path / "b"), {0: rows, 1: rows}, events=[])
    assert "## Stragglers\n\nnone" in report.markdown(report.summarize(report.load(str(tmp_path / "b"))))


def _rgb(hex_color):
    return tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_timeline_png_shows_the_states(tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    write_run(str(tmp_path))
    s = report.report(str(tmp_path))
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(png))[..., :3]
    assert img.shape[0] > 300 and img.shape[1] > 600

    def mask(color):
        return np.all(np.abs(img - np.array(_rgb(color))) < 0.02, axis=-1)

    green, red, gray = (mask(report.STATE_COLORS[k]) for k in ("training", "down", "starting"))
    rows_with = lambda m: set(np.nonzero(m.any(axis=1))[0])  # noqa: E731
    # three bar rows of training; the down state only appears on one of them
    assert green.sum() > 10000 and red.sum() > 50 and gray.sum() > 1000
    red_rows = rows_with(red[:, 150:])  # skip the legend's patch area on the right
    green_cols_in_red_rows = green[sorted(red_rows)].any(axis=0).sum()
    assert green_cols_in_red_rows > 100  # replica 1 also trained before and after
    # time runs left to right: on the killed replica's row, green, then red, then gray, then green
    r = sorted(red_rows)[len(red_rows) // 2]
    seq = []
    for x in range(img.shape[1]):
        for name, m in (("g", green), ("r", red), ("s", gray)):
            if m[r, x] and (not seq or seq[-1] != name):
                seq.append(name)
    assert "".join(seq).startswith("sgrsg") or "grsg" in "".join(seq), seq
    # the other replicas' rows have no red
    others = [y for y in rows_with(green) if y not in red_rows]
    assert others and not red[others][:, :int(img.shape[1] * 0.85)].any()
    assert s["failures"][0]["replica"] == 1


def test_report_of_a_missing_run_says_so(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "no run directory" in capsys.readouterr().err


def test_a_hang_diagnosis_is_reported_with_rank_link_and_stack(tmp_path):
    rows = [(T0 + i * STEP, i, [0, 1, 2], 0) for i in range(1, 31)]
    stack = 'Thread 77 (idle): "MainThread"\n    wait (threading.py:331)\n    exchange (manager.py:790)\n'
    ev = {"t": T0 + 10, "event": "hang", "replica": 1, "incarnation": 0, "diagnosis": True, "rank": 0, "state": "T",
          "links": [{"from": 1, "to": 2, "direction": "rx", "outstanding": 2180, "seen_by": 2, "waited_s": 1.1}],
          "stack": stack, "stacks": {"0": stack}, "reason": "replica 1 rank 0 (pid 77) is stopped (SIGSTOP); ..."}
    plain = {"t": T0 + 12, "event": "hang", "replica": 1, "incarnation": 0, "reason": "hung: members/1 vanished"}
    write_steps(str(tmp_path), {0: rows, 2: rows}, events=[ev, plain])
    s = report.summarize(report.load(str(tmp_path)))
    assert [(h["replica"], h["rank"], h["state"], h["frame"]) for h in s["hangs"]] == [
        (1, 0, "T", "exchange (manager.py:790)")]
    md = report.markdown(s)
    assert "## Hangs" in md
    assert "| 1 | 0 | 0 | T | r1 -> r2 (rx, 2180 B, seen by r2) | `exchange (manager.py:790)` |" in md
    assert "wait (threading.py:331)" in md and "is stopped (SIGSTOP)" in md
    write_steps(str(tmp_path / "b"), {0: rows, 1: rows}, events=[])
    assert "## Hangs\n\nnone" in report.markdown(report.summarize(report.load(str(tmp_path / "b"))))


def test_an_incarnation_killed_before_its_first_step_is_starting_then_down(tmp_path):
    """A restart that dies before it trains has no steps.jsonl row (the 100-fault soak's run
    directories have many): the timeline shows it starting, then down, and does not fail."""
    d = str(tmp_path)
    t_kill, t_back = write_run(d)
    with open(os.path.join(d, "events.jsonl"), "a") as f:  # replica 2: a second incarnation dies unborn
        for e in ({"t": T0 + 5.0, "event": "exit", "replica": 2, "incarnation": 0, "code": -9},
                  {"t": T0 + 5.01, "event": "evict", "replica": 2, "incarnation": 0, "reason": "killed"},
                  {"t": T0 + 5.5, "event": "restart", "replica": 2, "incarnation": 5},
                  {"t": T0 + 6.5, "event": "exit", "replica": 2, "incarnation": 5, "code": -9},
                  {"t": T0 + 6.51, "event": "evict", "replica": 2, "incarnation": 5, "reason": "killed"}):
            f.write(json.dumps(e) + "\n")
    data = report.load(d)
    segs = report.segments(data, 3)[2]
    assert (5.5, 6.5, "starting") in [(round(a, 2), round(b, 2), st) for a, b, st in segs]
    report.report(d, png=True)
    assert os.path.getsize(os.path.join(d, "timeline.png")) > 0


def test_a_run_with_warm_spares_reports_them_and_its_numbers_are_unchanged(tmp_path):
    """The spares' events belong to no replica (launch/supervisor.py): the report counts them and
    the promotions, and reads the rest as before (it raised KeyError 'replica' on them)."""
    write_run(str(tmp_path))
    path = tmp_path / "events.jsonl"
    events = [json.loads(l) for l in path.read_text().splitlines()]
    for e in events:
        if e["event"] == "restart":
            e["standby"] = "s1"
    events += [{"t": T0 + 0.1, "event": "spare_start", "token": "s1", "pids": [7]},
               {"t": T0 + 20.0, "event": "spare_start", "token": "s2", "pids": [8]},
               {"t": T0 + 40.0, "event": "spare_stop", "token": "s2", "reason": "the job ended"}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    s = report.report(str(tmp_path), png=False)
    assert (s["restarts"], s["standby_restarts"], s["spares_started"]) == (1, 1, 2)
    assert s["ett"] == pytest.approx((60 - 13 / 3) / 60, abs=1e-4)
