"""The `lightning-ft` command (DESIGN §9).

    lightning-ft etcd [--host 127.0.0.1] [--port 2379] [--data-dir DIR]
        Run a single-member etcd in the foreground for a job to use (Ctrl-C stops it).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time


def _cmd_etcd(a: argparse.Namespace) -> int:
    from lightning_ft.coord.etcd_server import EtcdNotFound, EtcdServer

    try:
        srv = EtcdServer(host=a.host, port=a.port, data_dir=a.data_dir).start()
    except (EtcdNotFound, RuntimeError) as e:
        print(f"lightning-ft etcd: {e}", file=sys.stderr)
        return 1
    print(f"etcd listening on {srv.endpoint} (data in {srv.data_dir}); pass --etcd {srv.endpoint} to jobs. "
          "Ctrl-C stops it.", flush=True)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop["now"]:
            if srv.proc is None or srv.proc.poll() is not None:
                print("lightning-ft etcd: etcd exited unexpectedly; see " + srv.log_path, file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        if a.data_dir:
            srv.stop()
        else:
            srv.cleanup()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-ft", description="Fault-tolerant HSDP for PyTorch Lightning")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("etcd", help="run an etcd server in the foreground")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=2379)
    e.add_argument("--data-dir", default=None, help="keep data here (default: a temp dir removed at exit)")
    e.set_defaults(fn=_cmd_etcd)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
