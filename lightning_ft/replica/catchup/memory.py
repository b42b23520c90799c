"""A process-local catch-up transport for fast tests (the contract: catchup_transport.py): no
sockets, no MACs; a registry maps addresses to transports, and a fetch copies the published
bytes straight into the fetcher's tensors under the server's lock. It refuses what the HTTP
transport refuses, with the same `CatchupError`s (statuses, server versions, messages): a wrong
secret (401), nothing published (404), another version (409), a state frozen after every
expected fetcher completed (410), a layout that is not the fetcher's, meta `check_meta` rejects."""
from __future__ import annotations

import hmac
import itertools
import json
import threading
import time
from typing import Optional

import torch

from lightning_ft.replica.catchup.transport import CatchupTransport
from lightning_ft.replica.catchup.wire import (MAX_PARTS, CatchupError, bytes_of, check_layout, check_meta, log,
                                               spec_of, status_error)

_ids = itertools.count(1)
_registry: dict[str, "InMemoryTransport"] = {}
"""Port (the address's part after its last ':') -> the open transport serving there."""
_registry_lock = threading.Lock()


class _Publication:
    def __init__(self, version: int, tensors: dict[str, torch.Tensor], meta: dict, expected: frozenset[str]) -> None:
        self.version, self.expected = version, expected
        self.specs = [spec_of(n, t) for n, t in tensors.items()]
        self.meta = json.loads(json.dumps(meta))  # a snapshot, as the wire's JSON header is
        self.tensors: Optional[list[torch.Tensor]] = [bytes_of(t) for t in tensors.values()]
        """Byte views of the live tensors; clones after a freeze that kept them; None once dropped."""
        self.completed: set[str] = set()
        self.frozen = False


class InMemoryTransport(CatchupTransport):
    """Serves at "memory:<n>" (any host before the last ':' reaches it) in this process."""

    def __init__(self, secret: bytes, bind_host: str = "", name: str = "") -> None:
        self.name = name or "state server"
        self._secret = bytes(secret)
        self._lock = threading.Lock()
        self._pub: Optional[_Publication] = None
        self.frozen_bytes = 0
        """Bytes cloned by the last freeze()."""
        port = str(next(_ids))
        self._address = f"memory:{port}"
        with _registry_lock:
            _registry[port] = self

    @property
    def address(self) -> str:
        return self._address

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict,
                expected: set[str] | frozenset[str] = frozenset()) -> None:
        tensors = {n: t.detach().to("cpu") if t.device.type != "cpu" else t for n, t in tensors.items()}
        pub = _Publication(int(version), tensors, meta, frozenset(expected))
        with self._lock:
            self._pub = pub
            self.frozen_bytes = 0

    def freeze(self) -> float:
        t0 = time.perf_counter()
        with self._lock:  # a fetch copies under the lock: none is in flight
            pub = self._pub
            if pub is None or pub.frozen or pub.tensors is None:
                return time.perf_counter() - t0
            if pub.expected - pub.completed:
                pub.tensors = [t.clone() for t in pub.tensors]
                self.frozen_bytes = sum(t.numel() for t in pub.tensors)
            else:
                pub.tensors = None
            pub.frozen = True
        return time.perf_counter() - t0

    def retire(self) -> None:
        with self._lock:
            self._pub = None

    def completed(self) -> set[str]:
        with self._lock:
            return set(self._pub.completed) if self._pub else set()

    def close(self) -> None:
        self.retire()
        with _registry_lock:
            _registry.pop(self._address.rpartition(":")[2], None)

    def fetch(self, address: str, version: int, into: dict[str, torch.Tensor], fetcher: str,
              timeout_s: float = 30.0, param_groups: Optional[list[dict]] = None,
              streams: Optional[int] = None) -> tuple[dict, dict]:
        where = f"catch-up from {address} (version {version})"
        if not (fetcher.isascii() and fetcher.isprintable() and fetcher.strip() == fetcher and fetcher):
            raise ValueError(f"fetcher id must be printable ASCII without surrounding spaces, got {fetcher!r}")
        if streams is not None and not 1 <= int(streams) <= MAX_PARTS:
            raise ValueError(f"streams must be between 1 and {MAX_PARTS}, got {streams}")
        with _registry_lock:
            server = _registry.get(address.rpartition(":")[2])
        if server is None:
            raise CatchupError(f"{where} failed: ConnectionRefusedError: nothing serves there; the healthy rank "
                               f"may have died or moved on — retry in the next round")
        t0 = time.perf_counter()
        meta, total = server._serve(self._secret, int(version), into, fetcher, param_groups, where)
        seconds = time.perf_counter() - t0
        return meta, {"bytes": total, "seconds": seconds, "gbps": total / max(seconds, 1e-9) / 1e9, "streams": 1}

    def _serve(self, secret: bytes, version: int, into: dict[str, torch.Tensor], fetcher: str,
               param_groups: Optional[list[dict]], where: str) -> tuple[dict, int]:
        """Check the request and the layout, then copy the bytes into `into` (a fetcher's call)."""
        if not hmac.compare_digest(secret, self._secret):
            log.warning("%s refused a catch-up request from %s: bad HMAC (wrong job secret)", self.name, fetcher)
            raise status_error(where, 401, "authentication failed")
        # host staging for device tensors, as the HTTP client: a refused fetch leaves them as they were
        staged = {n: torch.empty(t.shape, dtype=t.dtype) if t.device.type != "cpu" else t for n, t in into.items()}
        with self._lock:
            pub = self._pub
            if pub is None:
                raise status_error(where, 404, f"{self.name} has nothing published")
            if pub.version != version:
                raise status_error(where, 409, f"{self.name} has version {pub.version}, not {version}", pub.version)
            if pub.tensors is None:
                raise status_error(where, 410, f"{self.name} froze version {version} after all expected fetchers "
                                               f"finished and no longer holds its tensors")
            check_layout(pub.specs, staged, where)
            meta = check_meta(pub.meta, param_groups) if param_groups is not None else json.loads(json.dumps(pub.meta))
            for dst, src in zip(staged.values(), pub.tensors, strict=True):
                bytes_of(dst).copy_(src)
            pub.completed.add(fetcher)
        for name, t in into.items():
            if t is not staged[name]:
                t.copy_(staged[name])
        return meta, sum(s["nbytes"] for s in pub.specs)
