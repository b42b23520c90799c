"""A short digest of a rank's training state, to check that replicas are bitwise identical."""
from __future__ import annotations

import hashlib

import torch


def _bytes(t: torch.Tensor) -> bytes:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 (16 hex digits) over this rank's parameter shards and optimizer-state shards."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(_bytes(p))
    for group in opt.param_groups:
        for p in group["params"]:
            for _, v in sorted(opt.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    h.update(_bytes(v))
    return h.hexdigest()[:16]
