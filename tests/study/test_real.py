"""Reading a real run back (lightning_ft/study/real.py): curves from steps.jsonl and eval.jsonl, the
launcher command, the ledger's batches from a MemoryStore. No processes."""
from __future__ import annotations

import json

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.store import MemoryStore
from lightning_ft.study.real import RealRunFailed, RealSpec, command, ledger, read_run, run_id


def _rows(path, rows, torn=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        if torn:
            f.write('{"t": 9, "st')        # a SIGKILLed writer's last line


def _row(step, t, role, loss, contributors, slots=1):
    return {"step": step, "t": t, "role": role, "loss": loss, "contributors": contributors, "slots": slots}


def test_read_run_weights_losses_by_slot_batches_and_takes_the_first_commit_time(tmp_path):
    # step n is committed by the call that reports state version n + 1
    _rows(tmp_path / "replica_0" / "steps.jsonl", [
        _row(0, 100.0, "adopt", None, [0]),
        _row(1, 101.0, "train", 2.0, [0, 1]),
        _row(2, 102.0, "train", 1.0, [0], slots=2),      # replica 1 down: 0 trains its slot too
        _row(3, 103.5, "train", 1.5, [0, 1])])
    _rows(tmp_path / "replica_1" / "steps.jsonl", [
        _row(1, 100.9, "train", 4.0, [0, 1]),
        _row(3, 103.0, "catchup", None, [0, 1]),
        _row(3, 103.2, "train", 0.5, [0, 1])], torn=True)
    _rows(tmp_path / "replica_0" / "eval.jsonl", [{"step": 3, "val_bpb": 3.3}])
    _rows(tmp_path / "replica_1" / "eval.jsonl", [{"step": 3, "val_bpb": 3.3}])
    got = read_run(str(tmp_path), replicas=2, steps=3)
    assert got["train_loss"] == [pytest.approx(3.0), pytest.approx(1.0), pytest.approx(1.0)]
    assert got["contributors"] == [[0, 1], [0], [0, 1]]
    assert got["wall"] == [pytest.approx(0.0), pytest.approx(1.1), pytest.approx(2.1)]
    assert got["eval"] == {3: 3.3}


def test_read_run_names_the_steps_without_train_rows(tmp_path):
    _rows(tmp_path / "replica_0" / "steps.jsonl", [_row(1, 1.0, "train", 2.0, [0])])
    with pytest.raises(RealRunFailed, match=r"no train rows for steps \[1, 2\]"):
        read_run(str(tmp_path), replicas=1, steps=3)


def test_ledger_gives_each_steps_slot_batches_and_refuses_gaps():
    store, root = MemoryStore(), keys.root("/lft", "j", "r1")
    for step, batches in enumerate([{0: 0, 1: 0}, {0: 1}, {0: 2, 1: 1}]):
        for rid in batches:
            store.put(keys.commit(root, 0, step, rid),
                      json.dumps({"batches": batches, "contributors": list(batches)}).encode())
    for slot, c in ((0, 3), (1, 2)):
        store.put(keys.cursor(root, slot), str(c).encode())
    got = ledger(store, root, replicas=2, steps=3)
    assert got["batches"] == [{0: 0, 1: 0}, {0: 1}, {0: 2, 1: 1}]
    with pytest.raises(RealRunFailed, match=r"expected 0..3"):
        ledger(store, root, replicas=2, steps=4)


def test_command_kills_through_failure_events_and_run_id_is_read(tmp_path):
    spec = RealSpec("examples/train_moe.py", ["--batch", "8"], 1, "bf16-emulated", "sqrt", "constant", 4, 50,
                    [{"replica": 3, "step": 20, "kind": "kill", "downtime_steps": 10}])
    cmd = command(spec, "RD", "jobx", "127.0.0.1:1")
    assert cmd[cmd.index("--replicas") + 1] == "4" and cmd[cmd.index("--job") + 1] == "jobx"
    assert "failure.events=[{replica: 3, step: 20, kind: kill, downtime_steps: 10}]" in cmd
    assert {"lr_intervention=sqrt", "batch_policy=constant", "seed=1"} <= set(cmd)
    assert cmd[cmd.index("--precision") + 1] == "bf16-emulated"
    with pytest.raises(RealRunFailed, match="run_id is missing"):
        run_id(str(tmp_path))
    (tmp_path / "run_id").write_text("20261201-1\n")
    assert run_id(str(tmp_path)) == "20261201-1"
