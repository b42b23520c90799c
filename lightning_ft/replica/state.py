"""A replica rank's training state as named local tensors, and cheap digests of it
(docs/ARCHITECTURE.md, "Catch-up" and "The divergence guard").

The catch-up path moves exactly these tensors (parameters, buffers, optimizer state), and the
param groups and scheduler state as meta; the divergence guard digests the same tensors and
the param groups' numbers (`hyperparameters`), so whatever a catch-up makes identical is what
the guard compares, the learning rate included.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def param_layout(named_params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The model's parameter names, global shapes and dtypes, hashed: replicas of one job
    must agree on it (a joiner with another model is refused at registration). Readable
    enough to tell models apart: "n=6 numel=3201 sha=1f0c...". FSDP2's DTensors report
    their global shape, so it does not depend on the sharding."""
    h = hashlib.sha256()
    n = numel = 0
    for name, p in named_params:
        h.update(f"{name}|{tuple(p.shape)}|{str(p.dtype).removeprefix('torch.')}\n".encode())
        n += 1
        numel += p.numel()
    return f"n={n} numel={numel} sha={h.hexdigest()[:12]}"


def opt_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def state_tensors(named_params: list[tuple[str, torch.nn.Parameter]], model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's state shard as named local tensors: parameters, buffers, optimizer state.

    `named_params` are captured once while FSDP2's parameters are the sharded DTensors (during
    forward and backward it swaps unsharded tensors into the module)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named_params:
        out[f"param.{name}"] = local(p.data if not hasattr(p, "to_local") else p).detach()
    for name, b in model.named_buffers():
        out[f"buffer.{name}"] = local(b).detach()
    for i, p in enumerate(opt_params(optimizer)):
        for key, v in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(v):
                out[f"optim.{i}.{key}"] = local(v).detach()
    return out


def hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The numbers in each param group that the optimizer steps with (lr, betas, weight decay,
    ...) as named float64 tensors, for the digest: a catch-up carries them (with the scheduler
    state), so a replica whose learning rate went astray is caught by the divergence guard at
    the next digest, before its parameters drift."""
    out: dict[str, torch.Tensor] = {}
    for i, g in enumerate(optimizer.param_groups):
        for key in sorted(k for k in g if k != "params"):
            vals = g[key] if isinstance(g[key], (tuple, list)) else (g[key],)
            nums = [float(v) for v in vals if isinstance(v, (bool, int, float)) or
                    (torch.is_tensor(v) and v.numel() == 1)]
            if nums:
                out[f"hparam.{i}.{key}"] = torch.tensor(nums, dtype=torch.float64)
    return out


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh replica has no optimizer state yet; take one step with zero grads and lr 0
    so that every state tensor exists, then zero every state tensor. Zeroed state is what
    lazy initialization creates (Adam/AdamW moments and step, SGD momentum), so a replica
    that ends up not catching up trains exactly as a fresh one would."""
    params = opt_params(optimizer)
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g, _ in saved:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in saved:
        g["lr"] = lr
    for p, gr in zip(params, grads, strict=True):
        p.grad = gr
    with torch.no_grad():
        for p in params:
            for v in optimizer.state.get(p, {}).values():
                if torch.is_tensor(v):
                    local(v).zero_()


def _word_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as the widest integer words that tile them (never a copy of
    contiguous memory)."""
    flat = t.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    raw = flat.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and nbytes >= size:
            return raw.view(dtype)
    return raw


def tensor_word_sum(t: torch.Tensor) -> int:
    """Sum of the tensor's bytes read as integer words, mod 2**64. Any single flipped bit
    changes it, and it is order independent (threads, chunking), so bitwise-identical
    tensors give equal sums on every machine. It reads memory once: ~10 GB/s on one core."""
    t = local(t)
    if t.numel() == 0:
        return 0
    if t.device.type != "cpu":
        t = t.cpu()
    return int(_word_view(t).sum(dtype=torch.int64)) & (2**64 - 1)


def fast_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """64-bit digest of named tensors: sha256 over (name, word sum) of each, in order."""
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(struct.pack("<Q", tensor_word_sum(t)))
    return int.from_bytes(h.digest()[:8], "little")


def combine(rank_digests: Iterable[int]) -> str:
    """The replica digest from its ranks' digests (order: by rank), as 16 hex digits."""
    h = hashlib.sha256()
    for d in rank_digests:
        h.update(struct.pack("<Q", int(d) & (2**64 - 1)))
    return h.hexdigest()[:16]


def flip_bit(model: torch.nn.Module, bit: int = 20) -> str:
    """Silent data corruption for tests: flip one bit of the first element of the first
    parameter's local shard. Returns the parameter's name."""
    name, p = next(iter(model.named_parameters()))
    with torch.no_grad():
        t = local(p.data if not hasattr(p, "to_local") else p).view(-1)
        words = t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)
        words[0] ^= 1 << (bit % (8 * words.element_size() - 1))
    return name
