"""The `lightning-ft` command (DESIGN §9).

    lightning-ft run --replicas R --nproc-per-replica W [--etcd HOST:PORT] [--config cfg.yaml]
                     [--replica-ids 0,1] [--run-dir DIR] [--no-status] script.py [script args] [key=value ...]
        Start R replicas of W processes of `script.py` under the supervisor: an embedded etcd
        unless --etcd is given, evictions written at once on a death, restarts, a live status
        table and `events.jsonl` in the run directory. After the script, `ft.key=value` arguments
        are config overrides (configs/default.yaml), and so is `key=value` with a config key when
        the script is not a Hydra app; everything else, and all after a lone `--`, reaches the
        script verbatim (launch/argsplit.py). A Hydra app's `ft:` node is read first (lightning_ft/
        hydra.py). The resolved config is written to RUN_DIR/config.yaml and its path passed to
        every process as LFT_CONFIG.

    lightning-ft etcd [--host 127.0.0.1] [--port 2379] [--data-dir DIR]
        Run a single-member etcd in the foreground for a job to use (Ctrl-C stops it).

Multi-node: run `lightning-ft etcd --host 0.0.0.0` (or use your own etcd) and start one
`lightning-ft run --etcd HOST:PORT --replica-ids ...` per node with the same job settings,
or start each replica's processes with torchrun/srun and the LFT_* variables of DESIGN §9.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_ft.hydra import AppConfig


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


def _cmd_run(a: argparse.Namespace) -> int:
    import os
    import secrets

    from lightning_ft.config import ConfigError, checkpoint_dir, load_config, to_yaml
    from lightning_ft.hydra import LAUNCHER_READ_ENV
    from lightning_ft.launch.argsplit import SEPARATOR
    from lightning_ft.launch.supervisor import Supervisor

    if a.script == SEPARATOR and a.args:  # `lightning-ft run [flags] -- script.py ...`
        a.script = a.args.pop(0)
    if not os.path.exists(a.script):
        print(f"lightning-ft run: no such script: {a.script}", file=sys.stderr)
        return 2
    try:
        overrides, script_args, app = _split_run_args(a)
    except ConfigError as e:
        print(f"lightning-ft run: {e}", file=sys.stderr)
        return 2
    resume_from = None
    if a.resume:
        if a.config is None and os.path.exists(os.path.join(a.resume, "config.yaml")):
            a.config = os.path.join(a.resume, "config.yaml")  # the run's own config, then the overrides
        a.run_dir = a.resume
    for key, val in (("replicas", a.replicas), ("nproc_per_replica", a.nproc_per_replica), ("job", a.job),
                     ("etcd.endpoint", a.etcd), ("run_dir", a.run_dir)):
        if val is not None:
            overrides.append(f"{key}={val}")
    try:
        cfg = load_config(a.config, overrides, app=app.ft if app is not None else None,
                          app_name=f"{a.script}: the Hydra config's node 'ft'")
    except ConfigError as e:
        print(f"lightning-ft run: {e}", file=sys.stderr)
        return 2
    if app is not None:  # LFT_RUN_DIR must not depend on the cwd: a Hydra app may chdir (hydra.job.chdir)
        cfg.run_dir = os.path.abspath(cfg.run_dir)
    if a.resume:
        from lightning_ft.config import checkpoint_dir
        from lightning_ft.replica.checkpoint import newest_valid

        found = newest_valid(checkpoint_dir(cfg), warn=lambda m: print(f"lightning-ft run: warning: {m}",
                                                                       file=sys.stderr, flush=True))
        if found is None:
            print(f"lightning-ft run: --resume {a.resume}: no checkpoint that verifies under "
                  f"{checkpoint_dir(cfg)}", file=sys.stderr)
            return 2
        resume_from = found[1]
        print(f"lightning-ft: resuming from {resume_from} (step {found[0]})", flush=True)
    os.makedirs(cfg.run_dir, exist_ok=True)
    replica_ids = [int(x) for x in a.replica_ids.split(",")] if a.replica_ids else None
    secret = cfg.secret or os.environ.get("LFT_SECRET")
    if not secret and replica_ids is not None:
        print("lightning-ft run: launchers on several nodes must share the job secret: pass secret=... "
              "or set LFT_SECRET on every node", file=sys.stderr)
        return 2
    secret = secret or secrets.token_hex(16)  # one launcher runs every replica: any secret will do
    config_path = os.path.abspath(os.path.join(cfg.run_dir, "config.yaml"))
    with open(config_path, "w") as f:
        f.write(to_yaml(cfg))
    server = None
    endpoint = cfg.etcd.endpoint
    if not endpoint:
        from lightning_ft.coord.etcd_server import EtcdServer

        server = EtcdServer().start()
        endpoint = server.endpoint
    if resume_from is not None:
        _seed_resume(endpoint, cfg, resume_from)
    sup = None

    def on_term(signum, frame):  # unwind through the finally below: stop replicas and etcd
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        print(f"lightning-ft: job {cfg.job!r}: {cfg.replicas} replicas x {cfg.nproc_per_replica} processes, "
              f"etcd {endpoint}{' (embedded)' if server else ''}, run dir {cfg.run_dir}", flush=True)
        sup = Supervisor([sys.executable, a.script, *script_args], replicas=cfg.replicas,
                         nproc_per_replica=cfg.nproc_per_replica, job=cfg.job, etcd=endpoint, secret=secret,
                         run_dir=cfg.run_dir, replica_ids=replica_ids, restart_delay_s=cfg.failure.restart_delay_s,
                         max_restarts=a.max_restarts, prefix=cfg.etcd.prefix, restart=a.restart,
                         checkpoint_root=checkpoint_dir(cfg), crash_loop=cfg.supervisor.crash_loop,
                         min_replicas=cfg.min_replicas,
                         env={"LFT_CONFIG": config_path, **({"LFT_RESUME": os.path.abspath(resume_from)}
                                                            if resume_from else {}),
                              **({LAUNCHER_READ_ENV: "1"} if app is not None else {})})
        sup.start()
        if a.no_status or not sys.stdout.isatty():
            rc = sup.run(timeout_s=a.timeout)
        else:
            rc = _run_with_status(sup, a.timeout)
        _print_summary(sup, rc)
        return rc
    finally:
        if sup is not None:
            sup.shutdown()
        if server is not None:
            server.cleanup()


def _split_run_args(a: argparse.Namespace) -> tuple[list[str], list[str], AppConfig | None]:
    """(FT overrides, the script's arguments, the Hydra app's config or None); see launch/argsplit.py."""
    from lightning_ft.config import ConfigError
    from lightning_ft.hydra import is_hydra_app, read_app_config
    from lightning_ft.launch.argsplit import ArgSplitError, split_run_args, unprefixed_ft_keys

    hydra_app = is_hydra_app(a.script)
    run_flags = [s for action in a.run_parser._actions for s in action.option_strings]
    try:
        split = split_run_args(a.args, hydra_app=hydra_app, run_flags=run_flags)
    except ArgSplitError as e:
        raise ConfigError(str(e)) from None
    if not hydra_app:
        return split.ft_overrides, split.script_args, None
    print(f"lightning-ft: reading the Hydra app's config ({a.script} --cfg job)", flush=True)
    try:
        app = read_app_config([sys.executable, a.script, *split.script_args])
    except ConfigError as e:
        hint = [h for h in unprefixed_ft_keys(split.script_args) if f"'{h.split('=', 1)[0]}'" in str(e)]
        if hint:
            raise ConfigError(f"{e}\nnote: with a Hydra app every key=value is the app's; lightning-ft's own keys "
                              f"take the ft. prefix, e.g. ft.{hint[0]}") from None
        raise
    return split.ft_overrides, split.script_args, app


def _seed_resume(endpoint: str, cfg, ckpt: str) -> None:
    """A whole-job restart starts a fresh job keyspace whose cursors are the checkpoint's."""
    from lightning_ft.coord.store import EtcdStore
    from lightning_ft.replica.checkpoint import seed_job

    store = EtcdStore(endpoint)
    try:
        root = f"{cfg.etcd.prefix.rstrip('/')}/{cfg.job}/"
        store.delete_prefix(root)
        seed_job(store, root, ckpt)
    finally:
        store.close()


def _status_table(sup) -> "object":
    from rich.table import Table

    t = Table(title="lightning-ft")
    for col in ("replica", "state", "incarnation", "step", "restarts", "last event"):
        t.add_column(col)
    for st in sup.status():
        t.add_row(str(st["rid"]), st["state"], str(st["incarnation"]), str(st.get("step", "")),
                  str(st.get("restarts", 0)), str(st.get("last_event", ""))[:60])
    return t


def _run_with_status(sup, timeout_s) -> int:
    from rich.live import Live

    box = {"rc": None}

    def until() -> bool:
        live.update(_status_table(sup))
        return False

    with Live(_status_table(sup), refresh_per_second=4) as live:
        box["rc"] = sup.run(until=until, timeout_s=timeout_s, poll_s=0.25)
    return box["rc"]


def _print_summary(sup, rc: int) -> None:
    if sup.halted:
        print(f"lightning-ft run: the job halted: {sup.halted}", flush=True)
    if sup.stopped:
        print(f"lightning-ft run: {sup.stopped}", flush=True)
    for st in sup.status():
        print(f"replica {st['rid']}: {st['state']}, incarnation {st['incarnation']}, "
              f"restarts {st.get('restarts', 0)}, step {st.get('step', '?')}")
    print(f"lightning-ft run: exit code {rc}; events in {sup.run_dir}/events.jsonl, logs in {sup.run_dir}/logs",
          flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-ft", description="Fault-tolerant HSDP for PyTorch Lightning")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("etcd", help="run an etcd server in the foreground")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=2379)
    e.add_argument("--data-dir", default=None, help="keep data here (default: a temp dir removed at exit)")
    e.set_defaults(fn=_cmd_etcd)
    r = sub.add_parser("run", help="start and supervise the replicas of a training script")
    r.add_argument("--replicas", type=int, default=None, help="R (default: config `replicas`)")
    r.add_argument("--nproc-per-replica", type=int, default=None, help="W (default: config `nproc_per_replica`)")
    r.add_argument("--etcd", default=None, help="external etcd HOST:PORT (default: start an embedded one)")
    r.add_argument("--config", default=None, help="YAML config (see configs/default.yaml)")
    r.add_argument("--job", default=None)
    r.add_argument("--run-dir", default=None)
    r.add_argument("--replica-ids", default="", help="comma-separated ids this launcher runs (multi-node)")
    r.add_argument("--max-restarts", type=int, default=10)
    r.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    r.add_argument("--no-status", action="store_true", help="no live table (events still go to events.jsonl)")
    r.add_argument("--restart", choices=["replica", "world"], default="replica",
                   help="replica: FT-HSDP, only the failed replica restarts (default); world: the baseline, "
                        "any failure restarts every replica from the newest checkpoint")
    r.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="whole-job restart: resume RUN_DIR from its newest checkpoint that verifies")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER,
                   help="the script's arguments, and ft.key=value config overrides (README: Hydra apps)")
    r.set_defaults(fn=_cmd_run, run_parser=r)
    rep = sub.add_parser("report", help="timeline.png and summary.md of a run directory")
    rep.add_argument("run_dir")
    rep.add_argument("--no-png", action="store_true")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    rep.set_defaults(fn=_cmd_report)
    from lightning_ft.study.__main__ import DESCRIPTION, add_arguments

    st = sub.add_parser("study", help="the MoE accuracy study with injected failures", description=DESCRIPTION)
    add_arguments(st)
    st.set_defaults(fn=_cmd_study)
    return p


def _cmd_report(a: argparse.Namespace) -> int:
    from lightning_ft.report import main as report_main

    return report_main([a.run_dir] + (["--no-png"] if a.no_png else []) + (["--json"] if a.json else []))


def _cmd_study(a: argparse.Namespace) -> int:
    from lightning_ft.study.__main__ import run

    return run(a)


def main(argv: list[str] | None = None) -> int:
    from lightning_ft.launch.argsplit import protect_separator

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # keep a lone `--` after the script: argparse would drop it
        argv = protect_separator(argv)
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
