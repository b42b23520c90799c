"""Catch-up fetch throughput against a torch.save/torch.load peer, in the same run (docs/ARCHITECTURE.md, "Catch-up").

    python -m lightning_ft.bench.catchup [--mb 100 400] [--clients 1 2] [--streams 1 4] [--iters 3]
                                         [--peer-iters 1] [--netns] [--tcp]

This process publishes an fp32 state of M MB (four large tensors and a 0-dim step) on a
`StateServer`. N client subprocesses, each with the state preallocated, fetch it at the same
time with `fetch_state`, over each of the `--streams` settings (parallel connections; 1 is
the serial fetch of before issue 25), alternating round by round so that they are compared
under the same machine load. `--netns`: the clients run in a network namespace and reach
the server through a veth and a bridge (needs root; see bench/netns.py). The peer is the
naive path: the server pickles the same state with `torch.save` into a BytesIO per request
and sends it over a plain TCP socket; the client receives it whole, `torch.load`s it
(weights_only) and copies it into its tensors.
One JSON line per case, from the median of `iters` timed rounds after one warm-up (the peer:
median of `peer_iters` rounds, no warm-up; it is 10x slower and would dominate the run time):
    {"bench": "catchup", "state_mb": M, "clients": N, "net": "loopback" | "netns", "streams": S,
     "gbps": ..., "seconds": ..., "gbps_by_streams": {"1": ..., "4": ...}, "rounds_by_streams": {..},
     "local_parts": ..., "tcp_gbps": ..., "wire_gbps": ..., "of_wire": ..., "peer_gbps": ..., "peer_seconds": ...}
(S, gbps, seconds: the largest --streams setting; rounds_by_streams: each timed round's GB/s.)
gbps is aggregate: N x state bytes / the slowest client's seconds (1e9 bytes per GB).
The wire: in every timed round, after the fetches, the same bytes go over S plain TCP
connections of the same processes, straight from the tensors into the client's tensors, with no
protocol, no authentication and no copy beyond the kernel's: `wire_gbps` (median) is what the
machine's sockets give, and `of_wire` = gbps / wire_gbps what the authenticated fetch keeps of
it. On this 2-core machine both ends share the cores, so the two MACs (one per side) cost
throughput that more cores would hide.
The fetches use the server's same-host listener (an abstract Unix socket, no MAC over the
tensor bytes) where the client reaches it, as a replica's do: `local_parts` counts the parts
that went that way over the timed rounds (0 across network namespaces, or with `--tcp`).
`tcp_gbps`: the same fetch at S streams forced over TCP with its MACs, in the same rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, cast

import torch

from lightning_ft.replica.catchup.http import STREAMS, StateServer, fetch_state
from lightning_ft.replica.catchup.wire import bytes_of, pieces

if TYPE_CHECKING:
    from typing_extensions import Buffer

_LEN = struct.Struct(">Q")


def _layout(mb: float) -> list[tuple[str, list[int]]]:
    numel = int(mb * 1e6) // 4 // 4
    return [(f"layers.{i}.weight", [numel]) for i in range(4)] + [("step", [])]


def _state(mb: float) -> dict[str, torch.Tensor]:
    # The bytes' values do not matter to either path (no compression); full() is fast to make.
    return {name: torch.full(shape, 0.5 + i) for i, (name, shape) in enumerate(_layout(mb))}


# ------------------------------------------------------------------------------- client process


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("peer server closed early")
        got += n


def _peer_fetch(address: str, into: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = bytearray(_LEN.size)
        _recv_exact(sock, memoryview(head))
        blob = bytearray(_LEN.unpack(head)[0])
        _recv_exact(sock, memoryview(blob))
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    for name, t in into.items():
        t.copy_(loaded[name])
    return time.perf_counter() - t0


def _wire_fetch(address: str, into: dict[str, torch.Tensor], streams: int) -> float:
    """The same bytes as a fetch, over `streams` plain connections, each asking for its part
    [lo, hi) and receiving it straight into the tensors (no header, no MAC)."""
    views = [memoryview(cast("Buffer", bytes_of(t).numpy())) for t in into.values()]
    sizes = [len(v) for v in views]
    total = sum(sizes)
    host, port = address.rsplit(":", 1)
    errors: list[BaseException] = []

    def part(i: int) -> None:
        lo, hi = total * i // streams, total * (i + 1) // streams
        try:
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(_LEN.pack(lo) + _LEN.pack(hi))
                for k, a, b in pieces(sizes, lo, hi):
                    _recv_exact(sock, views[k][a:b])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=part, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def _client(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    secret = os.environ["LFT_BENCH_SECRET"].encode()
    into: dict[str, torch.Tensor] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "alloc":  # zeros() touches the pages: a lagging replica has its model allocated
            into = {name: torch.zeros(shape) for name, shape in _layout(float(rest[0]))}
            out = {"seconds": 0.0}
        elif cmd == "fetch":
            _, stats = fetch_state(args.client, int(rest[0]), into, secret, args.fetcher, timeout_s=60,
                                   streams=int(rest[1]), local=rest[2] == "local")
            out = {"seconds": stats["seconds"], "bytes": stats["bytes"], "local": stats["local"]}
        elif cmd == "peer":
            out = {"seconds": _peer_fetch(rest[0], into)}
        elif cmd == "wire":
            out = {"seconds": _wire_fetch(rest[0], into, int(rest[1]))}
        else:
            return
        print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------- server process


class _PeerServer:
    """torch.save per request into a BytesIO, then length-prefixed over a plain socket."""

    def __init__(self, state: dict[str, torch.Tensor], bind: str = "127.0.0.1") -> None:
        self.state = state
        self.sock = socket.create_server((bind, 0))
        self.address = f"{bind}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = io.BytesIO()
            torch.save(self.state, buf)
            view = buf.getbuffer()
            conn.sendall(_LEN.pack(len(view)))
            conn.sendall(view)
            del view

    def close(self) -> None:
        self.sock.close()


class _WireServer(_PeerServer):
    """The wire's ceiling: each connection asks for [lo, hi) of the tensors' bytes (two 8-byte
    big-endian numbers) and gets exactly those bytes, sent from the tensors' memory."""

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            views = [memoryview(cast("Buffer", bytes_of(t).numpy())) for t in self.state.values()]
            ask = bytearray(2 * _LEN.size)
            _recv_exact(conn, memoryview(ask))
            lo, hi = _LEN.unpack(ask[:_LEN.size])[0], _LEN.unpack(ask[_LEN.size:])[0]
            for k, a, b in pieces([len(v) for v in views], lo, hi):
                conn.sendall(views[k][a:b])


def _stdout(p: subprocess.Popen) -> IO[str]:
    assert p.stdout is not None  # the clients run with stdout=PIPE
    return p.stdout


def _round(clients: list[subprocess.Popen], command: str, local: list[int] | None = None) -> float:
    """Send one command to every client at once; the slowest client's seconds (`local`: gets
    each client's count of parts fetched over the same-host listener)."""
    for p in clients:
        assert p.stdin is not None  # stdin=PIPE
        p.stdin.write(command + "\n")
        p.stdin.flush()
    results = [json.loads(_stdout(p).readline()) for p in clients]
    if local is not None:
        local.extend(r.get("local", 0) for r in results)
    return max(r["seconds"] for r in results)


def _start_clients(address: str, n: int, host=None) -> list[subprocess.Popen]:
    """`host`: a bench.netns Host to run the clients in (None: this namespace)."""
    env = dict(os.environ, LFT_BENCH_SECRET="bench-secret")
    popen = host.popen if host is not None else subprocess.Popen
    clients = [popen([sys.executable, "-m", "lightning_ft.bench.catchup", "--client", address,
                      "--fetcher", f"lagger{i}"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
               for i in range(n)]
    for p in clients:
        line = _stdout(p).readline()
        if not line:
            raise RuntimeError(f"bench client pid {p.pid} exited at start (rc {p.wait()})")
    return clients


def _case(mb: float, clients: list[subprocess.Popen], iters: int, peer_iters: int, peer: "_PeerServer | None",
          version: int, streams: list[int], net: str, wire: "_WireServer", local: bool) -> dict:
    n = len(clients)
    _round(clients, f"alloc {mb}")
    nbytes = n * sum(t.numel() * t.element_size() for t in _state_like(mb))
    for k in streams:  # warm-up
        _round(clients, f"fetch {version} {k} {'local' if local else 'tcp'}")
    top = max(streams)
    _round(clients, f"wire {wire.address} {top}")
    _round(clients, f"fetch {version} {top} tcp")
    ours: dict[int, list[float]] = {k: [] for k in streams}
    bare: list[float] = []
    tcp: list[float] = []
    parts: list[int] = []
    for _ in range(iters):  # paired: each round runs every setting, TCP and the wire, one after the other
        for k in streams:
            ours[k].append(_round(clients, f"fetch {version} {k} {'local' if local else 'tcp'}", parts))
        tcp.append(_round(clients, f"fetch {version} {top} tcp"))
        bare.append(_round(clients, f"wire {wire.address} {top}"))
    med = {k: statistics.median(v) for k, v in ours.items()}
    wire_s, tcp_s = statistics.median(bare), statistics.median(tcp)
    out = {"bench": "catchup", "state_mb": mb, "clients": n, "net": net, "streams": top,
           "gbps": round(nbytes / med[top] / 1e9, 3), "seconds": round(med[top], 4),
           "gbps_by_streams": {str(k): round(nbytes / med[k] / 1e9, 3) for k in streams},
           "rounds_by_streams": {str(k): [round(nbytes / x / 1e9, 2) for x in v] for k, v in ours.items()},
           "local_parts": sum(parts), "tcp_gbps": round(nbytes / tcp_s / 1e9, 3),
           "wire_gbps": round(nbytes / wire_s / 1e9, 3), "of_wire": round(wire_s / med[top], 3)}
    if peer is not None and peer_iters:
        ps = statistics.median([_round(clients, f"peer {peer.address}") for _ in range(peer_iters)])
        out.update(peer_gbps=round(nbytes / ps / 1e9, 3), peer_seconds=round(ps, 4))
    return out


def _state_like(mb: float) -> list[torch.Tensor]:
    return [torch.empty(shape) for _, shape in _layout(mb)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[100, 400])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--peer-iters", type=int, default=1, help="the peer is slow; it needs no warm-up (0: skip it)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, STREAMS],
                    help="parallel connections per fetch, each setting timed in every round")
    ap.add_argument("--netns", action="store_true", help="clients in a network namespace, over a veth and a bridge")
    ap.add_argument("--tcp", action="store_true", help="the fetches never use the same-host listener")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as a client of this address
    ap.add_argument("--fetcher", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return _client(args)
    with contextlib.ExitStack() as stack:
        host, bind = None, "127.0.0.1"
        if args.netns:
            from lightning_ft.bench.netns import Net
            net = stack.enter_context(Net())
            host, bind = net.host("c"), f"{net.subnet}.1"  # the server answers on the bridge
        _bench(args, host, bind)


def _bench(args: argparse.Namespace, host, bind: str) -> None:
    server = StateServer(b"bench-secret", bind_host=bind, name="bench")
    clients = _start_clients(server.address, max(args.clients), host)
    try:
        for version, mb in enumerate(args.mb):
            state = _state(mb)
            server.publish(version, state, {"step": version}, expected=set())
            peer = _PeerServer(state, bind) if args.peer_iters else None
            wire = _WireServer(state, bind)
            try:
                for n in args.clients:
                    case = _case(mb, clients[:n], args.iters, args.peer_iters, peer, version, args.streams,
                                 "netns" if host is not None else "loopback", wire, not args.tcp)
                    print(json.dumps(case), flush=True)
            finally:
                wire.close()
                if peer is not None:
                    peer.close()
    finally:
        for p in clients:
            if p.stdin is not None:
                p.stdin.close()  # EOF ends the client loop
        for p in clients:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.close()


if __name__ == "__main__":
    main()
