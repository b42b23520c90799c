"""The catch-up transport's interface (docs/ARCHITECTURE.md, "Catch-up"): one per training rank,
the server of its state shard and the client of the others'. `HTTPTransport` (catchup.py,
over the wire of `catchup_server.py`) is the job's; `InMemoryTransport` (catchup_memory.py) is
a process-local one for fast tests. Both honour the contract below."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

import torch

TransportFactory = Callable[[bytes, str, str], "CatchupTransport"]
"""(job secret, bind host, name) -> a rank's transport; `HTTPTransport` and `InMemoryTransport` are ones."""


class CatchupTransport(ABC):
    """Serves this rank's state shard (one publication at a time) and fetches a peer's.

    Server side (the training thread): `publish` keeps *live* references to the tensors (no copy;
    device tensors are copied to host memory at publish) and a snapshot of the meta, which must
    be JSON (a fetcher receives it decoded, so tuples arrive as lists). Until `freeze`, a fetch
    may see in-place changes the owner made after publish; the owner calls `freeze` before it
    mutates them (optimizer.step), and no fetch observes a change made after freeze returned:
    freeze keeps (copies) what an expected fetcher that has not completed may still need, or,
    when all of them completed, drops the state (a later fetch: status 410). `retire` drops the
    publication (later fetches: 404); `publish` replaces it. Fetches in flight of a replaced or
    retired publication fail. `completed` names the fetchers (ids as in `fetch`) that completed
    a fetch of the current publication.

    Client side: `fetch` writes the bytes straight into the preallocated `into` (same names,
    dtypes and shapes, in order, else CatchupError naming the tensor) and returns (meta, stats).
    Every failure is a `CatchupError` (catchup_wire.py) with `status` (HTTP's: 401 wrong secret,
    404 nothing published, 409 another version, with `server_version`, 410 frozen and dropped;
    None: no answer) and `partial` (bytes of `into` were overwritten: the state is lost);
    `not_yet_published(version)` says whether a retry may succeed. The secret both sides hold
    authenticates the exchange: a fetcher without it gets status 401 and nothing is written."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where fetchers reach this rank's state: "host:port"; the replica layer replaces the
        host by the advertised one, so a transport must resolve the address by its port."""

    @abstractmethod
    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict,
                expected: set[str] | frozenset[str] = frozenset()) -> None:
        """Serve `tensors` (contiguous, live) and `meta` as `version`; `expected`: the fetcher ids
        whose fetch `freeze` keeps the state for."""

    @abstractmethod
    def freeze(self) -> float:
        """Stop reading the live tensors before the owner mutates them; the seconds it took."""

    @abstractmethod
    def retire(self) -> None:
        """Drop the publication."""

    @abstractmethod
    def completed(self) -> set[str]:
        """Fetcher ids that completed a fetch of the current publication."""

    @abstractmethod
    def close(self) -> None:
        """Retire and stop serving; the address is no longer reachable."""

    @abstractmethod
    def fetch(self, address: str, version: int, into: dict[str, torch.Tensor], fetcher: str,
              timeout_s: float = 30.0, param_groups: Optional[list[dict]] = None,
              streams: Optional[int] = None) -> tuple[dict, dict]:
        """Fetch `version` from the transport at `address` into `into`, as `fetcher` (printable
        ASCII, e.g. "r2/rank0"). `timeout_s` bounds each wait for the server; `streams`: parallel
        parts (None: the transport's choice; HTTP's only). With `param_groups` (the local
        optimizer's), meta is `check_meta`'s, checked before a byte is written. Returns (meta,
        {"bytes", "seconds", "gbps", "streams"}) once the bytes are verified and written."""
