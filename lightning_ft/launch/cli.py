"""The `lightning-ft` command (docs/ARCHITECTURE.md, "Launch and supervision").

    lightning-ft run --replicas R --nproc-per-replica W [--etcd HOST:PORT[,...] | --etcd-members N] [--config cfg.yaml]
                     [--replica-ids 0,1] [--run-dir DIR] [--no-status] script.py [script args] [key=value ...]
        Start R replicas of W processes of `script.py` under the supervisor: an embedded etcd
        (N members with --etcd-members) unless --etcd is given, evictions written at once on a
        death, restarts, a live status table and `events.jsonl` in the run directory. After the
        script, `ft.key=value` arguments are config overrides (configs/default.yaml), and so is
        `key=value` with a config key when the script is not a Hydra app; everything else, and
        all after a lone `--`, reaches the script verbatim (launch/argsplit.py). A Hydra app's
        `ft:` node is read first (lightning_ft/hydra.py). The resolved config is written to
        RUN_DIR/config.yaml and its path passed to every process as LFT_CONFIG.

    lightning-ft etcd [--host 127.0.0.1] [--port 2379] [--members N] [--data-dir DIR] [--unsafe-no-fsync]
                      [--cert-file PEM --key-file PEM [--client-ca-file PEM]]
        Run etcd in the foreground for jobs to use (Ctrl-C stops it): one member, or N members
        on ports PORT+2i; a member that dies is restarted on its data and rejoins. fsync stays on
        unless --unsafe-no-fsync. A data dir that does not exist is created.

    lightning-ft env --replica-id R [--replicas N] [--etcd HOST:PORT] [--job J] [--run-dir DIR] [key=value ...]
        Print (`export K=V`, for eval) the variables one replica's processes need when torchrun
        or srun starts them: LFT_JOB, LFT_REPLICA_ID, LFT_NUM_REPLICAS, LFT_ETCD, LFT_RUN_DIR,
        LFT_CONFIG (RUN_DIR/config.yaml, written) and LFT_SECRET_FILE (RUN_DIR/secret, created
        mode 0600 when no secret is given). Never the secret itself.

    lightning-ft plan [--preset paper] [--from-run RUN_DIR] [--gpus N] [--replicas R] [--overhead X] ...
        Effective training time of ft_hsdp and restart-the-world, the job size below which
        restart-the-world wins, a replica count, a picture (--png).

Multi-node: run `lightning-ft etcd --host 0.0.0.0` (or use your own etcd) and start one
`lightning-ft run --etcd HOST:PORT --replica-ids ...` per node with the same job settings,
or start each replica's processes with torchrun/srun and the LFT_* variables
(docs/ARCHITECTURE.md, "Launchers").
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

    from lightning_ft.hydra import AppConfig


def _cmd_etcd(a: argparse.Namespace) -> int:
    from lightning_ft.coord.etcd_server import EtcdCluster, EtcdNotFound, ServerTLS

    if bool(a.cert_file) != bool(a.key_file) or (a.client_ca_file and not a.cert_file):
        print("lightning-ft etcd: --cert-file and --key-file go together (TLS), and --client-ca-file needs them",
              file=sys.stderr)
        return 2
    tls = ServerTLS(a.cert_file, a.key_file, a.client_ca_file or "") if a.cert_file else None
    try:
        cluster = EtcdCluster(a.members, host=a.host, port=a.port, data_dir=a.data_dir,
                              unsafe_no_fsync=a.unsafe_no_fsync, tls=tls)
        if cluster.created_data_dir:
            print(f"lightning-ft etcd: created the data dir {cluster.data_dir}", flush=True)
        cluster.start()
    except (EtcdNotFound, RuntimeError, ValueError) as e:
        print(f"lightning-ft etcd: {e}", file=sys.stderr)
        return 1
    n = len(cluster.servers)
    what = f"{n} members" if n > 1 else "1 member"
    wildcard = " (with this machine's address for the wildcard host)" if a.host in ("0.0.0.0", "::") else ""
    print(f"etcd listening on {cluster.endpoint} ({what}, data in {cluster.data_dir}, "
          f"fsync {'OFF (--unsafe-no-fsync)' if a.unsafe_no_fsync else 'on'}); pass --etcd {cluster.endpoint} "
          f"to jobs{wildcard}. Ctrl-C stops it.", flush=True)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop["now"]:
            try:
                for i, code in cluster.heal_dead():
                    print(f"lightning-ft etcd: member {cluster.servers[i].name} exited (code {code}); "
                          f"{cluster.heal_verb}",
                          file=sys.stderr, flush=True)
            except RuntimeError as e:
                print(f"lightning-ft etcd: {e}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        if a.data_dir:
            cluster.stop()
        else:
            cluster.cleanup()
    return 0


def _cmd_env(a: argparse.Namespace) -> int:
    """Print the variables one replica needs under torchrun or srun (launch/environment.py)."""
    import os

    from lightning_ft import secret as job_secret
    from lightning_ft.config import ConfigError, load_config, parse_overrides, to_yaml
    from lightning_ft.launch.environment import format_variables, replica_variables

    overrides, rest = parse_overrides(a.overrides)
    if rest:
        print(f"lightning-ft env: unexpected arguments {rest}; only key=value config overrides follow the flags",
              file=sys.stderr)
        return 2
    for key, val in (("replicas", a.replicas), ("job", a.job), ("etcd.endpoint", a.etcd), ("run_dir", a.run_dir)):
        if val is not None:
            overrides.append(f"{key}={val}")
    try:
        cfg = load_config(a.config, overrides)
    except ConfigError as e:
        print(f"lightning-ft env: {e}", file=sys.stderr)
        return 2
    if not 0 <= a.replica_id < cfg.replicas:
        print(f"lightning-ft env: --replica-id {a.replica_id} is not a replica of this job: it must be between 0 and "
              f"replicas - 1 ({cfg.replicas - 1})", file=sys.stderr)
        return 2
    if not cfg.etcd.endpoint:
        print("lightning-ft env: replicas on several hosts need an etcd they all reach: pass --etcd HOST:PORT "
              "(e.g. from `lightning-ft etcd --host 0.0.0.0` on one node)", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    secret_path = os.path.join(run_dir, "secret")
    try:
        configured = "" if cfg.secret == job_secret.REDACTED else cfg.secret
        if os.environ.get(job_secret.FILE_ENV):
            secret_path = os.path.abspath(os.environ[job_secret.FILE_ENV])
            job_secret.read_file(secret_path)
        elif configured or os.environ.get(job_secret.VALUE_ENV):
            value = job_secret.resolve(configured)
            if os.path.exists(secret_path) and job_secret.read_file(secret_path) != value:
                print(f"lightning-ft env: {secret_path} holds another secret than the one given; remove it or "
                      f"point {job_secret.FILE_ENV} at it", file=sys.stderr)
                return 2
            if not os.path.exists(secret_path):
                job_secret.write_file(secret_path, value)
        elif os.path.exists(secret_path):
            job_secret.read_file(secret_path)
        else:
            job_secret.write_file(secret_path, job_secret.generate())
            print(f"lightning-ft env: wrote a new job secret to {secret_path} (mode 0600); every replica's "
                  f"processes must read the same file", file=sys.stderr)
    except job_secret.SecretError as e:
        print(f"lightning-ft env: {e}", file=sys.stderr)
        return 2
    cfg.run_dir = run_dir
    config_path = os.path.join(run_dir, "config.yaml")
    with open(config_path, "w") as f:
        f.write(to_yaml(cfg))
    variables = replica_variables(job=cfg.job, replica_id=a.replica_id, num_replicas=cfg.replicas,
                                  etcd=cfg.etcd.endpoint, run_dir=run_dir, config=config_path,
                                  secret_file=secret_path, run_id=a.run_id or "")
    print(format_variables(variables, a.format), flush=True)
    print(f"# then, on the host of replica {a.replica_id}: torchrun --nproc-per-node {cfg.nproc_per_replica} "
          f"--max-restarts 10 train.py   (or srun --ntasks {cfg.nproc_per_replica} python train.py); "
          f"docs/GUIDE.md: Multi-node", file=sys.stderr)
    return 0


def _cmd_run(a: argparse.Namespace) -> int:
    import os

    from lightning_ft.config import ConfigError, checkpoint_dir, load_config, to_yaml
    from lightning_ft.coord.runs import RunConflict
    from lightning_ft.hydra import LAUNCHER_READ_ENV
    from lightning_ft.launch.argsplit import SEPARATOR
    from lightning_ft.launch.supervisor import Supervisor
    from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings

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
                     ("etcd.endpoint", a.etcd), ("etcd.members", a.etcd_members), ("run_dir", a.run_dir),
                     ("supervisor.standby", a.standby)):
        if val is not None:
            overrides.append(f"{key}={val}")
    if a.etcd is not None:
        overrides.append("etcd.endpoints=[]")  # --etcd replaces the config's endpoints
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
    from lightning_ft import secret as job_secret

    try:  # a resumed run's config.yaml shows the secret as "***": never a secret, so not used
        secret = job_secret.resolve("" if cfg.secret == job_secret.REDACTED else cfg.secret, required=False)
    except job_secret.SecretError as e:
        print(f"lightning-ft run: {e}", file=sys.stderr)
        return 2
    if not secret and replica_ids is not None:
        print(f"lightning-ft run: launchers on several nodes must share the job secret: set "
              f"{job_secret.FILE_ENV} to a file holding it (mode 0600) on every node, or {job_secret.VALUE_ENV}",
              file=sys.stderr)
        return 2
    secret = secret or job_secret.generate()  # one launcher runs every replica: any secret will do
    config_path = os.path.abspath(os.path.join(cfg.run_dir, "config.yaml"))
    with open(config_path, "w") as f:
        f.write(to_yaml(cfg))
    from lightning_ft.coord.etcd_server import EtcdNotFound
    from lightning_ft.coord.store import StoreError
    from lightning_ft.constants import ExitCode
    from lightning_ft.launch.etcd_keeper import EtcdKeeper

    keeper = EtcdKeeper(cfg)
    try:
        endpoint = keeper.start()
    except (EtcdNotFound, RuntimeError, StoreError) as e:
        keeper.close()
        print(f"lightning-ft run: {e}", file=sys.stderr)
        return 2
    sup = None

    def on_term(signum, frame):  # unwind through the finally below: stop replicas and etcd
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        print(f"lightning-ft: job {cfg.job!r}: {cfg.replicas} replicas x {cfg.nproc_per_replica} processes, "
              f"{keeper.describe()}, run dir {cfg.run_dir}", flush=True)
        place = Placement(cfg.job, replicas=cfg.replicas, nproc_per_replica=cfg.nproc_per_replica, etcd=endpoint,
                          secret=secret, run_dir=cfg.run_dir, replica_ids=replica_ids, prefix=cfg.etcd.prefix,
                          wrap=os.environ.get("LFT_REPLICA_WRAP", ""),
                          env={"LFT_CONFIG": config_path, **keeper.child_env(),
                               **({"LFT_RESUME": os.path.abspath(resume_from)} if resume_from else {}),
                               **({LAUNCHER_READ_ENV: "1"} if app is not None else {})})
        settings = SupervisorSettings(restart=a.restart, restart_delay_s=cfg.failure.restart_delay_s,
                                      max_restarts=a.max_restarts, crash_loop=cfg.supervisor.crash_loop,
                                      min_replicas=cfg.min_replicas, checkpoint_root=checkpoint_dir(cfg),
                                      seed_from=resume_from or "", start_timeout_s=cfg.supervisor.start_timeout_s,
                                      exit_timeout_s=cfg.supervisor.exit_timeout_s, standby=cfg.supervisor.standby,
                                      zygote=cfg.supervisor.zygote,
                                      resume_wait_s=max(10.0, cfg.etcd.lease_ttl_s + 6.0))
        sup = Supervisor([sys.executable, a.script, *script_args], place, settings, store=keeper.store)
        try:
            sup.start()
        except RunConflict as e:
            print(f"lightning-ft run: {e}", file=sys.stderr, flush=True)
            return 2
        print(f"lightning-ft: {sup.run_reason}", flush=True)
        if a.no_status or not sys.stdout.isatty():
            rc = sup.run(until=keeper.tick, timeout_s=a.timeout)
        else:
            rc = _run_with_status(sup, a.timeout, keeper.tick)
        if keeper.lost is not None:
            rc = ExitCode.ETCD_LOST
            print(keeper.lost_message(checkpoint_dir(cfg), cfg.run_dir), file=sys.stderr, flush=True)
        _print_summary(sup, rc)
        return rc
    finally:
        if sup is not None:
            sup.shutdown()
        keeper.close()


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


def _status_table(sup) -> Table:
    from rich.table import Table

    t = Table(title="lightning-ft")
    for col in ("replica", "state", "incarnation", "step", "restarts", "compute", "last event"):
        t.add_column(col)
    for st in sup.status():
        t.add_row(str(st["rid"]), st["state"], str(st["incarnation"]), str(st.get("step", "")),
                  str(st.get("restarts", 0)), _compute_cell(st), str(st.get("last_event", ""))[:60])
    return t


def _compute_cell(st: dict) -> str:
    """'12.3 ms (1.02x)': the replica's compute per step and its ratio to the others' median
    (coord/stragglers.py); '' before it is measured."""
    ms, ratio = st.get("compute_ms"), st.get("compute_ratio")
    if ms is None:
        return ""
    return f"{ms:.1f} ms" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _run_with_status(sup, timeout_s, stop) -> int:
    from rich.live import Live

    def until() -> bool:
        live.update(_status_table(sup))
        return stop()

    with Live(_status_table(sup), refresh_per_second=4) as live:
        rc: int = sup.run(until=until, timeout_s=timeout_s, poll_s=0.25)
    return rc


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
    e = sub.add_parser("etcd", help="run an etcd server (or a cluster of them) in the foreground")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=2379,
                   help="client port of member 0; member i listens on PORT+2i, its peer port is PORT+2i+1")
    e.add_argument("--members", type=int, default=1, help="cluster size; 3 survive the loss of one (default 1)")
    e.add_argument("--data-dir", default=None,
                   help="keep data here, created if missing (default: a temp dir removed at exit)")
    e.add_argument("--unsafe-no-fsync", action="store_true",
                   help="skip fsync (faster, loses recent writes if the machine crashes); for tests")
    e.add_argument("--cert-file", default=None, help="TLS: the server certificate (PEM); clients use https://")
    e.add_argument("--key-file", default=None, help="TLS: its private key")
    e.add_argument("--client-ca-file", default=None, help="TLS: require client certificates signed by this CA")
    e.set_defaults(fn=_cmd_etcd)
    v = sub.add_parser("env", help="print the variables one replica needs under torchrun or srun")
    v.add_argument("--replica-id", type=int, required=True, help="the replica these processes are")
    v.add_argument("--replicas", type=int, default=None, help="R (default: config `replicas`)")
    v.add_argument("--etcd", default=None, help="HOST:PORT of an etcd every host reaches")
    v.add_argument("--job", default=None)
    v.add_argument("--run-dir", default=None, help="where config.yaml, the secret file and the logs go")
    v.add_argument("--config", default=None, help="YAML config (see configs/default.yaml)")
    v.add_argument("--run-id", default=None, help="the job's run (default: SLURM_JOB_ID under srun, else the "
                                                  "run the first replica starts)")
    v.add_argument("--format", choices=["sh", "env", "json"], default="sh",
                   help="sh: `export K=V` lines for eval; env: K=V lines; json")
    v.add_argument("overrides", nargs="*", help="key=value config overrides")
    v.set_defaults(fn=_cmd_env)
    r = sub.add_parser("run", help="start and supervise the replicas of a training script")
    r.add_argument("--replicas", type=int, default=None, help="R (default: config `replicas`)")
    r.add_argument("--nproc-per-replica", type=int, default=None, help="W (default: config `nproc_per_replica`)")
    r.add_argument("--etcd", default=None,
                   help="external etcd HOST:PORT, https://HOST:PORT for TLS, members separated by commas "
                        "(default: start an embedded one)")
    r.add_argument("--etcd-members", type=int, default=None,
                   help="members of the embedded etcd (default: config etcd.members, 1); 3 survive losing one")
    r.add_argument("--config", default=None, help="YAML config (see configs/default.yaml)")
    r.add_argument("--job", default=None)
    r.add_argument("--run-dir", default=None)
    r.add_argument("--replica-ids", default="", help="comma-separated ids this launcher runs (multi-node)")
    r.add_argument("--max-restarts", type=int, default=10)
    r.add_argument("--standby", type=int, default=None, metavar="N",
                   help="keep N warm spare replicas; a failed replica's restart takes one (default: config "
                        "supervisor.standby, 0)")
    r.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    r.add_argument("--no-status", action="store_true", help="no live table (events still go to events.jsonl)")
    r.add_argument("--restart", choices=["replica", "world"], default="replica",
                   help="replica: FT-HSDP, only the failed replica restarts (default); world: the baseline, "
                        "any failure restarts every replica from the newest checkpoint")
    r.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="whole-job restart: resume RUN_DIR from its newest checkpoint that verifies")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER,
                   help="the script's arguments, and ft.key=value config overrides (docs/GUIDE.md: Hydra apps)")
    r.set_defaults(fn=_cmd_run, run_parser=r)
    rep = sub.add_parser("report", help="timeline.png and summary.md of a run directory")
    rep.add_argument("run_dir")
    rep.add_argument("--no-png", action="store_true")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    rep.set_defaults(fn=_cmd_report)
    # `plan` and `study` parse their own arguments (sim/plan.py, study/__main__.py): the training
    # path (run, env, etcd) never imports sim/ or study/.
    pl = sub.add_parser("plan", help="effective training time of ft_hsdp and restart-the-world for a job",
                        add_help=False)
    pl.add_argument("args", nargs=argparse.REMAINDER)
    pl.set_defaults(fn=_cmd_plan)
    st = sub.add_parser("study", help="the MoE accuracy study with injected failures", add_help=False)
    st.add_argument("args", nargs=argparse.REMAINDER)
    st.set_defaults(fn=_cmd_study)
    return p


def _cmd_report(a: argparse.Namespace) -> int:
    from lightning_ft.report import main as report_main

    return report_main([a.run_dir] + (["--no-png"] if a.no_png else []) + (["--json"] if a.json else []))


def _cmd_plan(a: argparse.Namespace) -> int:
    from lightning_ft.sim.plan import add_arguments, run

    p = argparse.ArgumentParser(prog="lightning-ft plan",
                                description="effective training time of ft_hsdp and restart-the-world for a job")
    add_arguments(p)
    return run(p.parse_args(a.args))


def _cmd_study(a: argparse.Namespace) -> int:
    from lightning_ft.study.__main__ import DESCRIPTION, add_arguments, run

    p = argparse.ArgumentParser(prog="lightning-ft study", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(a.args))


def main(argv: list[str] | None = None) -> int:
    from lightning_ft.launch.argsplit import protect_separator

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # keep a lone `--` after the script: argparse would drop it
        argv = protect_separator(argv)
    if argv[:1] == ["plan"]:  # their own parsers (options first, which REMAINDER would not take)
        return _cmd_plan(argparse.Namespace(args=argv[1:]))
    if argv[:1] == ["study"]:
        return _cmd_study(argparse.Namespace(args=argv[1:]))
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
