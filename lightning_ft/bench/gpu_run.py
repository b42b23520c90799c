"""The GPU path in one call on a lent GPU machine (docs/ARCHITECTURE.md, "The GPU path").

    bash lightning_ft/bench/gpu_run.sh [--dry-run] [--only job,overhead] [--budget-s 470]   # make gpu-check

Installs the bundle's wheels into the image's Python with --no-index (bench/gpu_bundle.py; `make
gpu-bundle` made them here and the device call carries them), then runs every GPU check, each
step a process tree of its own with its own timeout, all within `--budget-s`:

    install   gpu_bundle install: pip --no-index, then etcd, gRPC, omegaconf, ... used for real
    compile   gpu_check compile: the Triton kernels compiled for this GPU's architecture
    kernels   gpu_check kernels,bandwidth,matmul: exact against torch; GB/s against the copy
              bandwidth; a concurrent bf16 matmul's slowdown
    ftar      gpu_check ftar: FTAR's device path bitwise against the CPU path, its GB/s
    job       gpu_check job: 2 replicas of examples/train_lm.py on the GPU, a kill and a rejoin
    overhead  bench.overhead --accelerator cuda: ft_hsdp against Lightning DDP, 2 processes
              sharing the GPU, with the CPU account

A step that fails or times out does not stop the later ones. Every JSON line goes to stdout and
to $OUT/gpu_run.jsonl, everything the steps print to $OUT/gpu_run.log, the job's run directory
(logs, events) to $OUT/job_logs.tar.gz; the last lines are one summary per step (its figures
against the targets of docs/ARCHITECTURE.md, "The GPU path") and one for the run.

--dry-run (or GPU_DRY_RUN=1): the same steps on the CPU with tiny sizes, no pip (the install
step only runs the smoke check in this Python): the kernels under TRITON_INTERPRET=1, the
CUDA-only parts print {"skipped": reason}. tests/bench/test_gpu_run.py runs it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Any, Callable

from lightning_ft.bench.gpu_bundle import FALLBACK_SITE, ROOT

BUDGET_S = 470
"""All steps on the GPU machine: a device call's 8 minutes, less a margin for the start."""
DRY_SLACK = 2
"""A dry run's budget and step timeouts are this many times the GPU's: a shared CPU is slower."""
PR_SET_CHILD_SUBREAPER = 36
TAIL_BYTES = 2 << 20
"""At most this much of each job log goes into job_logs.tar.gz (its end)."""


def _emit(sink: Any, **kw) -> None:
    line = json.dumps({"bench": "gpu_run", **kw})
    print(line, flush=True)
    sink.write(line + "\n")
    sink.flush()


# -- the steps --------------------------------------------------------------------------------------------

def steps(a: argparse.Namespace, work: str) -> list[tuple[str, list[str], float, dict]]:
    """(name, argv, timeout_s, extra env) of every step, in order."""
    py, dry = sys.executable, a.dry_run
    check = [py, "-m", "lightning_ft.bench.gpu_check"] + (["--dry-run"] if dry else [])
    install = [py, "-m", "lightning_ft.bench.gpu_bundle", "install", "--dir", a.bundle]
    if a.install == "no" or (a.install == "auto" and dry):
        install.append("--check-only")
    job = ["--job-kill-step", "8", "--job-after-steps", "10", "--job-timeout", "200"] if dry else [
        "--job-kill-step", "30", "--job-after-steps", "50", "--job-timeout", "110"]
    overhead = [py, "-m", "lightning_ft.bench.overhead", "--procs", "2", "--timeout", "100"] + (
        ["--accelerator", "cpu", "--ddp-launch", "external", "--rounds", "1", "--steps", "44", "--warmup", "4",
         "--width", "64", "--depth", "2", "--batch", "16"] if dry else
        ["--accelerator", "cuda", "--rounds", "2", "--steps", "200", "--warmup", "20"])
    return [
        ("install", install, 45, {}),
        ("compile", check + ["--checks", "compile"], 30, {}),
        ("kernels", check + ["--checks", "kernels,bandwidth,matmul"], 75, {"TRITON_INTERPRET": "1"} if dry else {}),
        ("ftar", check + ["--checks", "ftar"], 45, {}),
        ("job", check + ["--checks", "job", "--keep-dir", os.path.join(work, "job"), *job], 140, {}),
        ("overhead", overhead, 135, {}),
    ]


def _all(rows: list[dict], key: str) -> bool:
    return bool(rows) and all(r.get(key) is True for r in rows)


def figures(name: str, rows: list[dict]) -> tuple[dict, dict]:
    """A step's figures and its targets (name: met?) from the JSON lines it printed."""
    def of(check: str) -> list[dict]:
        return [r for r in rows if r.get("check") == check]

    if name == "install":
        smoke = [r for r in rows if r.get("step") == "smoke"]
        inst = [r for r in rows if r.get("step") == "install"]
        fallback = [r for r in rows if r.get("step") == "install_fallback"]
        return {"installed": inst[0].get("installed") if inst else "not run (check only)",
                **({"unpacked": fallback[0]["unpacked"], "site": fallback[0]["site"]} if fallback else {})}, {
            "etcd, gRPC, omegaconf, ... work": _all(smoke, "ok")}
    if name == "compile":
        c = of("compile")
        return {"arch": c[0]["arch"] if c else None, "triton": c[0]["triton"] if c else None}, {
            "every kernel compiles": _all(c, "ok")}
    if name == "kernels":
        k, bw, mm = of("kernels"), of("bandwidth"), of("matmul_slowdown")
        exact = bool(k) and all(r["copy_bitwise"] and r["reduce_bitwise"] and r["scale_bitwise"] for r in k)
        f: dict = {"dtypes": [r["dtype"] for r in k]}
        t: dict = {"kernels exact": exact}
        if bw:
            f.update({x: bw[0][x] for x in ("device_copy_gbps", "kernel_copy_gbps", "kernel_reduce_gbps",
                                            "copy_vs_device", "reduce_vs_device")})
            t["2 programs >= 50% of copy bandwidth"] = min(bw[0]["copy_vs_device"], bw[0]["reduce_vs_device"]) >= 0.5
        if mm:
            f["matmul_slowdown"] = mm[0]["slowdown"]
            t["concurrent matmul slowed <= 3%"] = mm[0]["slowdown"] <= 1.03
        skipped = [r["skipped"] for r in rows if r.get("check") == "matmul" and "skipped" in r]
        if skipped:
            f["matmul"] = "skipped: " + skipped[0]
        return f, t
    if name == "ftar":
        d, g = of("ftar_device_path"), of("ftar_device_gbps")
        return ({"dtypes": [r["dtype"] for r in d], "kernels": sorted({r["kernels"] for r in d}),
                 "pinned": sorted({r["pinned"] for r in d}),
                 **({x: g[0][x] for x in ("device_path_gbps", "cpu_path_gbps")} if g else {})},
                {"device path bitwise = CPU path": _all(d, "bitwise_vs_cpu_path")})
    if name == "job":
        j = of("replicas_kill_rejoin")
        if not j:
            return {}, {"replicas identical after a kill": False}
        r = j[0]
        t = {"replicas identical after a kill": r["identical"] and r["rc"] == 0}
        if isinstance(r["device_path"], bool):  # on a GPU; a string says why not
            t["every process on the device path"] = r["device_path"]
        return ({"steps": r["steps"], "rejoined_steps": r["rejoined_steps"], "processes": r["processes"],
                 "wall_s": r["wall_s"], "device_path": r["device_path"]}, t)
    if name == "overhead":
        o = [r for r in rows if r.get("bench") == "overhead"]
        if not o:
            return {}, {"ft_hsdp / DDP step time <= 1.03": False}
        r = o[0]
        return ({"ratio": r["ratio"], "cpu_ratio": r["cpu_ratio"], "ft_step_s": r["ft_step_s"],
                 "ddp_step_s": r["ddp_step_s"], "accelerator": r["accelerator"], "ddp": r["ddp"]},
                {"ft_hsdp / DDP step time <= 1.03": r["ratio"] <= 1.03})
    return {}, {}


# -- running a step ---------------------------------------------------------------------------------------

def _children() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(pid: int) -> list[int]:
    parents = _children()
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


def _kill_tree(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for p in pids:
            try:
                os.kill(p, sig)
                alive.append(p)
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(3 if sig == signal.SIGTERM else 0)


def _reap() -> None:
    """Collect the exit status of orphans reparented to us (we are their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_step(name: str, argv: list[str], timeout_s: float, env: dict, log: Any,
             on_line: Callable[[str], None]) -> tuple[int | str, float]:
    """Run one step to its end or its timeout; its JSON lines go to `on_line`, everything to `log`.
    At the timeout the step's process and all its descendants are ended."""
    log.write(f"\n===== {name}: {' '.join(argv)} (timeout {timeout_s:.0f} s)\n")
    log.flush()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT, bufsize=1)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:  # a thread: a step that prints half a line and hangs cannot hold us
            assert p.stdout is not None
            for line in p.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, name=f"gpu-run-{name}", daemon=True).start()
        deadline = t0 + timeout_s
        timed_out = False
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            log.write(line)
            if line.startswith("{"):
                on_line(line.rstrip("\n"))
        if timed_out:
            _kill_tree([p.pid, *descendants(p.pid)])
        try:
            rc: int | str = p.wait(10)
        except subprocess.TimeoutExpired:
            _kill_tree([p.pid])
            rc = p.wait()
        err.seek(0)
        log.write(err.read())
    log.flush()
    return ("timeout" if timed_out else rc), time.perf_counter() - t0


def end_leftovers(name: str, log: Any) -> None:
    """End what a step left running: our descendants, orphans reparented to us included (main
    makes this process their subreaper), and collect their exit status."""
    leftovers = descendants(os.getpid())
    if leftovers:
        log.write(f"[gpu_run] {name} left {len(leftovers)} processes running: ended\n")
        _kill_tree(leftovers)
    _reap()


def _tar_job(src: str, dst: str) -> None:
    """The job's run directory, each file cut to its last TAIL_BYTES."""
    if not os.path.isdir(src):
        return
    with tarfile.open(dst, "w:gz") as tar:
        for dirpath, _, files in os.walk(src):
            for fname in sorted(files):
                path = os.path.join(dirpath, fname)
                size = os.path.getsize(path)
                info = tarfile.TarInfo(os.path.relpath(path, src))
                info.size = min(size, TAIL_BYTES)
                with open(path, "rb") as f:
                    f.seek(size - info.size)
                    tar.addfile(info, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_DRY_RUN") == "1",
                   help="the same steps on the CPU, tiny sizes (default: GPU_DRY_RUN=1)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu-run"),
                   help="where the JSON lines, the log and the job's logs go (default: $OUT)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="all steps together end within this (470; a dry run: 900, each step's timeout doubled: "
                        "a shared CPU is slower than the GPU machine)")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu-bundle"))
    p.add_argument("--install", choices=("auto", "yes", "no"), default="auto",
                   help="pip install the bundle (auto: yes, but not in a dry run)")
    p.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    a = p.parse_args(argv)
    if a.budget_s is None:
        a.budget_s = DRY_SLACK * BUDGET_S if a.dry_run else BUDGET_S
    t0 = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    try:  # orphans of a step (a launcher's etcd, say) become our children, so that we can end them
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    shutil.rmtree(FALLBACK_SITE, ignore_errors=True)  # a previous run's: the install step decides anew
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    results = []
    with tempfile.TemporaryDirectory(prefix="lft-gpu-run-") as work, \
            open(os.path.join(a.out, "gpu_run.jsonl"), "w") as jl, open(os.path.join(a.out, "gpu_run.log"), "w") as log:
        _emit(jl, start=True, dry_run=a.dry_run, python=sys.executable, out=a.out, budget_s=a.budget_s,
              **machine())
        only = set(filter(None, a.only.split(",")))
        for name, cmd, timeout_s, extra in steps(a, work):
            if only and name not in only:
                continue
            left = a.budget_s - (time.perf_counter() - t0)
            rows: list[dict] = []

            def on_line(line: str, rows: list[dict] = rows) -> None:
                print(line, flush=True)
                jl.write(line + "\n")
                jl.flush()
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass

            if left < 10:
                rc: int | str = "skipped: out of time"
                wall = 0.0
            else:
                own = timeout_s * (DRY_SLACK if a.dry_run else 1)
                rc, wall = run_step(name, cmd, min(own, left), {**env, **extra}, log, on_line)
                end_leftovers(name, log)
            if name == "install" and os.path.isdir(FALLBACK_SITE):  # pip failed: the unpacked wheels
                env["PYTHONPATH"] += os.pathsep + FALLBACK_SITE
            if name == "job":
                _tar_job(os.path.join(work, "job"), os.path.join(a.out, "job_logs.tar.gz"))
            try:
                figs, targets = figures(name, rows)
                ok = rc == 0 and all(targets.get(k) for k in targets if k in CORRECTNESS)
            except (KeyError, IndexError, TypeError) as e:  # a line without what the summary reads
                figs, targets, ok = {"error": f"the summary could not read the step's lines: {e!r}"}, {}, False
            results.append({"summary": name, "ok": ok, "rc": rc, "wall_s": round(wall, 1), "figures": figs,
                            "targets": targets})
            _emit(jl, step=name, ok=ok, rc=rc, wall_s=round(wall, 1))
        for r in results:  # last: the device tool's answer shows the output's tail
            _emit(jl, **r)
        failed = [r["summary"] for r in results if not r["ok"]]
        _emit(jl, summary="all", ok=not failed, failed=failed, dry_run=a.dry_run,
              wall_s=round(time.perf_counter() - t0, 1))
    cap_log(os.path.join(a.out, "gpu_run.log"))
    return 0 if not failed else 1


def machine() -> dict:
    """What the image offers beside Python: the GPUs (nvidia-smi), a C compiler (Triton builds its
    launcher with one at the first kernel launch), the CPUs."""
    smi = shutil.which("nvidia-smi")
    gpus: Any = None
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=15)
            gpus = q.stdout.strip().splitlines() or q.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            gpus = "nvidia-smi did not answer in 15 s"
    return {"gpus": gpus, "cc": shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"),
            "cpus": os.cpu_count()}


LOG_CAP = 15 << 20
"""What comes back of one file of $OUT is at most 16 MiB: a longer log keeps its head and its tail."""


def cap_log(path: str) -> None:
    size = os.path.getsize(path)
    if size <= LOG_CAP:
        return
    with open(path, "rb") as f:
        head = f.read(LOG_CAP // 3)
        f.seek(size - 2 * LOG_CAP // 3)
        tail = f.read()
    with open(path, "wb") as f:
        f.write(head + f"\n[gpu_run: {size - len(head) - len(tail)} bytes cut]\n".encode() + tail)


CORRECTNESS = {"etcd, gRPC, omegaconf, ... work", "every kernel compiles", "kernels exact",
               "device path bitwise = CPU path", "replicas identical after a kill", "every process on the device path"}
"""Targets a step fails on; the others (GB/s, slowdown, overhead) are figures to report."""


if __name__ == "__main__":
    sys.exit(main())
