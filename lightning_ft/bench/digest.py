"""What the divergence guard's state digest costs, against a training step of the same model.

    python -m lightning_ft.bench.digest [--width 1024] [--depth 4] [--batch 256]

The model is bench.overhead's MLP (4.2M parameters at the defaults) with AdamW. One step =
forward, backward and AdamW on a batch of `--batch`, one thread. The digest reads every
parameter and optimizer-state tensor once (replica/state.py::fast_digest); sha256 over the
same bytes (replica/digest.py, the final.json digest) is measured beside it. Prints:

    {"bench": "digest", "state_mb": ..., "digest_ms": ..., "sha256_ms": ..., "step_ms": ...,
     "every_step_pct": ..., "every_n_for_1pct": ...}
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn


def _median_ms(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv: list[str] | None = None) -> int:
    from lightning_ft.replica.digest import state_digest
    from lightning_ft.replica.state import fast_digest, state_tensors

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    w = a.width
    model = nn.Sequential(*[m for _ in range(a.depth) for m in (nn.Linear(w, w), nn.GELU())], nn.Linear(w, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(a.batch, w), torch.randn(a.batch, 1)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()  # the optimizer state exists from here on
    named = list(model.named_parameters())
    tensors = sorted(state_tensors(named, model, opt).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    step_ms = _median_ms(step, a.repeats)
    digest_ms = _median_ms(lambda: fast_digest(tensors), a.repeats)
    sha_ms = _median_ms(lambda: state_digest(model, opt), max(3, a.repeats // 3))
    pct = 100 * digest_ms / step_ms
    print(json.dumps({"bench": "digest", "params": sum(p.numel() for p in model.parameters()),
                      "state_mb": round(nbytes / 1e6, 2), "digest_ms": round(digest_ms, 3),
                      "digest_gbps": round(nbytes / digest_ms / 1e6, 2), "sha256_ms": round(sha_ms, 3),
                      "step_ms": round(step_ms, 3), "every_step_pct": round(pct, 2),
                      "every_n_for_1pct": max(1, math.ceil(pct / 1.0))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
