"""The catch-up wire protocol: constants, request and response MACs, byte ranges (parts) of a
state, and the checks a fetcher applies to what it received. The format is in the docstring of
`lightning_ft/replica/catchup.py`; the server is `catchup_server.py`."""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import struct
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

SEND_CHUNK = 1 << 20
"""Bytes per send under one reader mark: bounds how long freeze() waits for sends in flight."""
RECV_CHUNK = 4 << 20
"""Bytes per recv_into on the fetcher."""
MAX_SKEW_S = 60.0
"""Largest accepted difference between the fetcher's X-LFT-Time and the server clock."""
ACK = b"\x06"
"""The byte a fetcher sends back, on every part's connection, after every part verified."""
MAC_BYTES = 16
META_KEYS = ("step", "param_groups", "scheduler", "scaler", "batches", "callbacks")
"""The meta a fetcher accepts; any other key a server sends is dropped."""
MAX_PARTS = 64
"""Most parts (parallel connections) one fetch may split a state into."""
_LEN = struct.Struct(">Q")
_PART = re.compile(r"^([0-9a-f]{8,64})\|(\d{1,3})/(\d{1,3})$")
log = logging.getLogger("lightning_ft.replica.catchup")


@dataclass(frozen=True)
class Part:
    """Part `index` of `count` of one fetch (`fetch` is its random id, shared by its parts): the
    bytes [lo, hi) of the concatenated tensor bytes, with lo = total * index // count."""

    fetch: str
    index: int
    count: int

    @property
    def header(self) -> str:
        """The X-LFT-Part request header (also bound into the request's HMAC)."""
        return f"{self.fetch}|{self.index}/{self.count}"

    @staticmethod
    def parse(value: str, nonce: str) -> Optional["Part"]:
        """The part a request asks for; no header: the whole state (a fetch of one part, whose
        id is the nonce). None if malformed."""
        if not value:
            return Part(nonce, 0, 1)
        m = _PART.match(value)
        if not m:
            return None
        index, count = int(m.group(2)), int(m.group(3))
        return Part(m.group(1), index, count) if 0 <= index < count <= MAX_PARTS else None

    def range(self, total: int) -> tuple[int, int]:
        return total * self.index // self.count, total * (self.index + 1) // self.count


def pieces(sizes: list[int], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """(tensor index, start, stop) byte slices of the tensors that cover [lo, hi) of their
    concatenation, in order."""
    off = 0
    for i, n in enumerate(sizes):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            yield i, a - off, b - off
        off += n
        if off >= hi:
            return


class CatchupError(RuntimeError):
    """A fetch failed. `status` is the server's HTTP status (None: no answer) and
    `server_version` the version it holds, when it said so (409)."""

    def __init__(self, message: str, status: Optional[int] = None, server_version: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status
        self.server_version = server_version
        self.partial = False
        """Some tensor bytes were already written into the destination: it is no longer
        the state it was before the fetch."""

    def not_yet_published(self, version: int) -> bool:
        """The server has nothing, or a version older than `version`: it may publish soon."""
        return self.status == 404 or (self.status == 409 and self.server_version is not None
                                      and self.server_version < version)


def status_error(where: str, status: int, reason: str, version: object = None) -> CatchupError:
    """The fetcher's error for a refusal: `status` (HTTP's), the server's `reason`, and the
    `version` it holds (its 409 says which)."""
    if status == 401:
        return CatchupError(f"{where} failed: authentication refused ({reason}); check that both replicas "
                            f"use the same job secret and their clocks agree within {MAX_SKEW_S:.0f} s", 401)
    if status == 409:
        return CatchupError(f"{where} failed: server has version {version}; the healthy replica moved on or has "
                            f"not published this version yet — retry", 409,
                            version if isinstance(version, int) else None)
    if status in (404, 410):
        return CatchupError(f"{where} failed: {reason} (HTTP {status}); the healthy replica is not "
                            f"serving this version — retry in the next round", status)
    return CatchupError(f"{where} failed: HTTP {status}: {reason}", status)


def check_layout(theirs: list[dict], into: dict[str, torch.Tensor], where: str) -> None:
    """The server's tensor list (`spec_of` each) must equal `into` (names, dtypes, shapes, in order)."""
    ours = [spec_of(n, t) for n, t in into.items()]
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):  # the lengths: after the loop
        for key in ("name", "dtype", "shape"):
            if a[key] != b[key]:
                raise CatchupError(f"{where} failed: tensor #{i} {b['name']!r}: server has {key} {a[key]} but "
                                   f"the local state has {b[key]}; both replicas must build the same model "
                                   f"and sharding")
    if len(theirs) != len(ours):
        extra = (theirs if len(theirs) > len(ours) else ours)[min(len(theirs), len(ours))]["name"]
        raise CatchupError(f"{where} failed: server has {len(theirs)} tensors, the local state {len(ours)} "
                           f"(first unmatched: {extra!r}); both replicas must build the same model and sharding")


def request_tag(secret: bytes, version: int, fetcher: str, nonce: str, stamp: str, part: str = "") -> str:
    """The request tag; `part` ("{fetch id}|{i}/{n}", see `Part`) is bound into it when given."""
    msg = f"{version}|{fetcher}|{nonce}|{stamp}" + (f"|{part}" if part else "")
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def local_tag(secret: bytes, nonce: str, name: str) -> str:
    """The tag of a server's answer to GET /local: its same-host (Unix socket) name, bound to
    the asker's nonce."""
    return hmac.new(secret, f"lft-catchup-local|{nonce}|{name}".encode(), hashlib.sha256).hexdigest()


def response_macs(secret: bytes, nonce: str, version: int, header: bytes, part: "Part") -> tuple[bytes, Poly1305]:
    """(header MAC, body MAC in progress: the header is in it, the part's tensor bytes follow).

    Poly1305 (~6.5 GB/s from memory on one core here; it holds the GIL, so a fetch overlaps it
    with other streams' recv, see `fetch_state`) with one-time keys derived from the secret,
    the request's nonce and the part: a server answers a nonce once, so no key authenticates
    two messages, and a response for one part cannot pass as another's."""
    def key(what: str) -> bytes:
        msg = f"lft-catchup-{what}|{nonce}|{int(version)}|{part.index}/{part.count}"
        return hmac.new(secret, msg.encode(), hashlib.sha256).digest()

    head = Poly1305(key("header"))
    head.update(header)
    body = Poly1305(key("body"))
    body.update(header)
    return head.finalize(), body


def check_meta(meta: object, param_groups: list[dict]) -> dict:
    """The part of a (verified) response's meta a fetcher may apply: known keys only, and in
    each param group only the keys the local group has, with values of the local type.
    Raises CatchupError when the structure cannot be ours (another optimizer)."""
    if not isinstance(meta, dict):
        raise CatchupError(f"meta is {type(meta).__name__}, not a mapping")
    out = {k: meta[k] for k in META_KEYS if k in meta}
    dropped = sorted(set(meta) - set(META_KEYS))
    if dropped:
        log.warning("catch-up: ignoring unknown meta keys %s", dropped)
    groups = out.get("param_groups", [])
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise CatchupError(f"the server's optimizer has {len(groups) if isinstance(groups, list) else '?'} param "
                           f"groups, ours {len(param_groups)}; both replicas must build the same optimizer")
    clean = []
    for i, (theirs, ours) in enumerate(zip(groups, param_groups, strict=True)):
        if not isinstance(theirs, dict):
            raise CatchupError(f"param group {i} from the server is not a mapping")
        group = {}
        for key, value in theirs.items():
            if key == "params" or key not in ours:
                continue
            mine = ours[key]
            if isinstance(mine, (tuple, list)) and isinstance(value, list) and len(value) == len(mine):
                value = type(mine)(value)
            elif isinstance(mine, bool) or mine is None:
                if not (value is None or isinstance(value, bool)):
                    raise CatchupError(f"param group {i} key {key!r}: server sent {value!r}, ours is {mine!r}")
            elif isinstance(mine, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CatchupError(f"param group {i} key {key!r}: server sent {value!r}, ours is {mine!r}")
            elif type(value) is not type(mine):
                raise CatchupError(f"param group {i} key {key!r}: server sent a {type(value).__name__}, ours is "
                                   f"a {type(mine).__name__}")
            group[key] = value
        clean.append(group)
    out["param_groups"] = clean
    for key in ("step", "batches"):
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int)):
            raise CatchupError(f"meta {key} {out[key]!r} is not an integer")
    if out.get("callbacks") is not None and not isinstance(out["callbacks"], str):
        raise CatchupError(f"meta callbacks is a {type(out['callbacks']).__name__}, not a string")
    if out.get("scaler") is not None:
        from lightning_ft.replica.scaler import ScalerStateError, check_state

        try:
            out["scaler"] = check_state(out["scaler"])
        except ScalerStateError as e:
            raise CatchupError(f"the server's loss scale cannot be applied: {e}") from None
    return out


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The flat uint8 view of a contiguous CPU tensor (0-dim and bf16 included); never a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"catch-up tensors must be contiguous CPU tensors, got device={t.device} "
                         f"contiguous={t.is_contiguous()}")
    return t.detach().view(-1).view(torch.uint8)  # (nbytes,)


def spec_of(name: str, t: torch.Tensor) -> dict:
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size()}
