"""examples/train_lm.py under `lightning-ft run`: plain Lightning code with strategy="ft_hsdp",
a real offline corpus, held-out evaluation, per-replica logs, one checkpoint writer."""
from __future__ import annotations

import csv
import os

from lightning_ft.report import load, summarize
from tests.strategy.runs import lft_run, ok

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_lm.py")


def test_train_lm_two_replicas(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "30", "--val-every", "15", "--d", "32", "--context", "32",
                  script=os.path.abspath(EXAMPLE))
    assert run.proc.returncode == 0, ok(run)
    s = summarize(load(run.run_dir))
    assert s["identical"] and s["steps"] == 30 and s["replicas"] == 2
    assert s["loss_last"] < s["loss_first"] < 6.0  # bytes: ln(256) = 5.5 at the start, then it learns
    assert run.ledger.ok and run.ledger.steps == 30
    logs = os.path.join(run.run_dir, "lightning_logs")
    for rid in (0, 1):  # each replica logs to its own directory: held-out bits/byte and FT metrics
        rows = list(csv.DictReader(open(os.path.join(logs, f"replica_{rid}", "metrics.csv"))))
        assert [float(r["val_bpb"]) for r in rows if r.get("val_bpb")], rows[-1]
        assert {float(r["ft/healthy"]) for r in rows if r.get("ft/healthy")} == {2.0}
    # only the checkpoint writer (the lowest-id contributor) saved Lightning checkpoints
    assert os.listdir(os.path.join(logs, "replica_0", "checkpoints"))
    assert not os.path.exists(os.path.join(logs, "replica_1", "checkpoints"))
