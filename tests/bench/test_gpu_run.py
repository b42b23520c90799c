"""The GPU path's one-call script (lightning_ft/bench/gpu_run.py, gpu_bundle.py, gpu_check.py,
gpu_job.py; docs/ARCHITECTURE.md, "The GPU path") without a GPU.

The dry run runs the script's very steps on the CPU with tiny sizes, once per module (about 40 s
on an idle machine; the steps' own timeouts, doubled in a dry run, bound it on a loaded one):
every step passes, the CUDA-only part says it was skipped, every JSON line and the logs land in
$OUT, and every third-party module our code imports on the way is one the GPU image has or the
bundle carries (an import trace of every process, each of our loaded modules' imports read back).
`make gpu-bundle` checks the bundle itself: its wheels installed with --no-index into a clean
Python 3.12 (this suite cannot: it needs the network to download them).
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
from packaging.requirements import Requirement

from lightning_ft.bench import gpu_bundle, gpu_run

ROOT = gpu_bundle.ROOT
STEPS = ["install", "compile", "kernels", "ftar", "job", "overhead"]

TRACE_HOOK = '''
import os
import sys

_PATH = os.environ.get("GPU_IMPORT_TRACE")
if _PATH:
    class _Trace:
        """Appends to GPU_IMPORT_TRACE every lightning_ft module this process imports, and its script."""

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "lightning_ft":
                with open(_PATH, "a") as out:
                    out.write("module " + name + "\\n")
            return None

    sys.meta_path.insert(0, _Trace())
    with open(_PATH, "a") as out:
        out.write("script " + os.path.abspath(sys.argv[0] if sys.argv and sys.argv[0] else "-") + "\\n")
'''

OPTIONAL = {
    "litdata": "strategy/data_shards.py, only when the program streams its data with litdata",
    "pyverbs": "ftar/transport/rdma.py, only with ftar.transport=rdma (Debian's python3-pyverbs)",
    "matplotlib": "sim/plan.py (loaded by the CLI's parser), only when `lightning-ft plan` draws its PNG",
}
"""Imports of our code, inside functions, that the GPU path never runs (the image lacks them)."""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The script's dry run, once: (exit code, JSON lines, $OUT, the import trace, seconds)."""
    tmp = tmp_path_factory.mktemp("gpu-run")
    hook, out, trace = tmp / "hook", tmp / "out", tmp / "trace.txt"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(TRACE_HOOK)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_DRY_RUN": "1",
           "GPU_IMPORT_TRACE": str(trace), "PYTHONPATH": f"{ROOT}{os.pathsep}{hook}"}
    t0 = time.monotonic()
    p = subprocess.run(["bash", os.path.join(ROOT, "lightning_ft", "bench", "gpu_run.sh")], env=env,
                       capture_output=True, text=True, timeout=1000)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return p, rows, out, trace, time.monotonic() - t0


def _summaries(rows: list[dict]) -> dict[str, dict]:
    return {r["summary"]: r for r in rows if r.get("bench") == "gpu_run" and "summary" in r}


@pytest.mark.integration
def test_dry_run_passes_every_step_and_ends_with_a_summary_per_step(dry_run):
    p, rows, _, _, _ = dry_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summaries = _summaries(rows)
    assert list(summaries) == [*STEPS, "all"]
    assert [r["step"] for r in rows if r.get("bench") == "gpu_run" and "step" in r] == STEPS
    assert all(s["ok"] and s["rc"] == 0 for s in summaries.values() if s["summary"] != "all"), summaries
    assert summaries["all"] == {**summaries["all"], "ok": True, "failed": [], "dry_run": True}
    # the summary lines come last: the device tool's answer shows the output's tail
    assert [r.get("summary") for r in rows[-len(STEPS) - 1:]] == [*STEPS, "all"]


@pytest.mark.integration
def test_dry_run_checks_what_a_cpu_can_and_says_what_it_skipped(dry_run):
    _, rows, _, _, _ = dry_run
    checks = [r for r in rows if r.get("bench") == "gpu_check"]
    compile_ = [r for r in checks if r.get("check") == "compile"]
    assert compile_[0]["ok"] and compile_[0]["arch"] == "sm_90" and len(compile_[0]["cubin_bytes"]) == 10
    assert all(b > 0 for b in compile_[0]["cubin_bytes"])
    kernels = [r for r in checks if r.get("check") == "kernels"]
    assert [r["dtype"] for r in kernels] == ["float32", "bfloat16", "float16"]
    assert all(r["copy_bitwise"] and r["reduce_bitwise"] and r["scale_bitwise"] for r in kernels)
    ftar = [r for r in checks if r.get("check") == "ftar_device_path"]
    assert len(ftar) == 2 and all(r["bitwise_vs_cpu_path"] and r["paths"] == {"device": i + 1}
                                  for i, r in enumerate(ftar))
    (skipped,) = [r for r in checks if r.get("check") == "matmul"]
    assert "CUDA" in skipped["skipped"]
    (job,) = [r for r in checks if r.get("check") == "replicas_kill_rejoin"]
    assert job["identical"] and job["rc"] == 0 and job["processes"] >= 3 and job["steps"][0] == job["steps"][1]
    assert job["rejoined_steps"] >= 10 and job["device_path"].startswith("not applicable")
    (overhead,) = [r for r in rows if r.get("bench") == "overhead"]
    assert overhead["accelerator"] == "cpu" and overhead["ddp"]["launch"] == "external"
    assert overhead["ft_step_s"] > 0 and overhead["ddp_step_s"] > 0
    (smoke,) = [r for r in rows if r.get("step") == "smoke"]
    assert smoke["ok"] and set(smoke["versions"]) == set(gpu_bundle.BUNDLE)


@pytest.mark.integration
def test_dry_run_writes_every_json_line_the_log_and_the_jobs_logs_into_out(dry_run):
    _, rows, out, _, _ = dry_run
    assert sorted(os.listdir(out)) == ["gpu_run.jsonl", "gpu_run.log", "job_logs.tar.gz"]
    with open(out / "gpu_run.jsonl") as f:
        assert [json.loads(line) for line in f] == rows
    log = (out / "gpu_run.log").read_text()
    assert all(f"===== {s}:" in log for s in STEPS)
    with tarfile.open(out / "job_logs.tar.gz") as tar:
        names = tar.getnames()
        events = [json.loads(line) for line in tar.extractfile("events.jsonl").read().splitlines()]
    assert "replica_0/final.json" in names and "replica_1/final.json" in names
    assert any(e["event"] == "exit" and e["replica"] == 1 and e["code"] == -9 for e in events)


def _image_closure() -> set[str]:
    """IMAGE's distributions and everything they require (this venv's metadata; no extras)."""
    seen, todo = set(), list(gpu_bundle.IMAGE)
    while todo:
        name = gpu_bundle._norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


def _imports(path: str) -> set[str]:
    """The top-level names of every absolute import in a file (inside functions too)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


@pytest.mark.integration
def test_every_module_our_code_imports_on_the_gpu_path_is_on_the_image_or_in_the_bundle(dry_run):
    _, _, _, trace, _ = dry_run
    lines = trace.read_text().splitlines()
    files = set()
    for line in lines:
        kind, name = line.split(" ", 1)
        if kind == "module":
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin and spec.origin.startswith(ROOT):
                files.add(spec.origin)
        elif name.startswith(ROOT) and name.endswith(".py"):
            files.add(name)
    # the launcher's zygote forks the workers and runs the script in them (no new interpreter to trace)
    files.add(os.path.join(ROOT, "examples", "train_lm.py"))
    assert os.path.join(ROOT, "lightning_ft", "strategy", "ft_hsdp.py") in files
    assert os.path.join(ROOT, "lightning_ft", "ftar", "transport", "staging.py") in files
    dists = md.packages_distributions()
    bundle = {gpu_bundle._norm(n) for n in gpu_bundle.BUNDLE}
    image = _image_closure()
    stray = {}
    for path in sorted(files):
        for top in _imports(path) - set(sys.stdlib_module_names) - {"lightning_ft", "__future__"} - set(OPTIONAL):
            found = {gpu_bundle._norm(d) for d in dists.get(top, [])}
            if not found or not found & (bundle | image):
                stray[top] = (os.path.relpath(path, ROOT), sorted(found))
    assert not stray, (f"imported on the GPU path, but neither on the GPU image nor in gpu-bundle: {stray}; "
                       "add it to gpu_bundle.BUNDLE (and REQUIREMENTS), or to OPTIONAL here with the reason")


# -- fast: no dry run -------------------------------------------------------------------------------------

def test_the_bundle_follows_pyproject():
    """Every dependency of pyproject.toml is on the image, in the bundle or left out with a reason;
    REQUIREMENTS are pyproject's own specs, and the pinned wheels satisfy them."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    reqs = {gpu_bundle._norm(r.name): r for r in map(Requirement, gpu_bundle.REQUIREMENTS)}
    norm = gpu_bundle._norm
    for d in deps:
        n = norm(d.name)
        assert n in reqs or n in {norm(i) for i in gpu_bundle.IMAGE} or d.name in gpu_bundle.LEFT_OUT, d
        if n in reqs:
            assert reqs[n].specifier == d.specifier, (reqs[n], d)
    pins = {norm(n): v for n, v in gpu_bundle.BUNDLE.items()}
    for n, r in reqs.items():
        assert n in pins and r.specifier.contains(pins[n], prereleases=True), (r, pins.get(n))


def test_the_size_check_fails_loudly_past_64_mib(tmp_path):
    big = tmp_path / "huge-1.0-py3-none-any.whl"
    with open(big, "wb") as f:
        f.truncate(65 << 20)  # sparse: no disk used
    with pytest.raises(SystemExit) as e:
        gpu_bundle.check_size(str(tmp_path))
    assert "over the 64 MiB a device call carries" in str(e.value) and "huge-1.0-py3-none-any.whl" in str(e.value)
    (tmp_path / "huge-1.0-py3-none-any.whl").unlink()
    (tmp_path / "small-1.0-py3-none-any.whl").write_bytes(b"x" * 1000)
    sizes = gpu_bundle.check_size(str(tmp_path))
    assert sizes["bundle"] == 1000 and 0 < sizes["tree"] < 32 << 20


def test_the_summary_reports_figures_against_the_targets():
    rows = [{"check": "kernels", "dtype": d, "copy_bitwise": True, "reduce_bitwise": True, "scale_bitwise": True}
            for d in ("float32", "bfloat16", "float16")]
    rows.append({"check": "bandwidth", "device_copy_gbps": 3000.0, "kernel_copy_gbps": 1800.0,
                 "kernel_reduce_gbps": 1200.0, "copy_vs_device": 0.6, "reduce_vs_device": 0.4})
    rows.append({"check": "matmul_slowdown", "slowdown": 1.02})
    figs, targets = gpu_run.figures("kernels", rows)
    assert figs["copy_vs_device"] == 0.6 and figs["matmul_slowdown"] == 1.02
    assert targets == {"kernels exact": True, "2 programs >= 50% of copy bandwidth": False,
                       "concurrent matmul slowed <= 3%": True}
    rows[1]["reduce_bitwise"] = False
    assert gpu_run.figures("kernels", rows)[1]["kernels exact"] is False
    job = {"check": "replicas_kill_rejoin", "identical": True, "rc": 0, "steps": [90, 90], "rejoined_steps": 50,
           "processes": 3, "wall_s": 40.0, "device_path": False}
    assert gpu_run.figures("job", [job])[1] == {"replicas identical after a kill": True,
                                                "every process on the device path": False}
    job["device_path"] = "not applicable: the CPU job takes the CPU path"
    assert gpu_run.figures("job", [job])[1] == {"replicas identical after a kill": True}
    # a step that printed nothing (it crashed or timed out) fails its correctness target
    assert gpu_run.figures("job", [])[1] == {"replicas identical after a kill": False}
    assert gpu_run.figures("overhead", [])[1] == {"ft_hsdp / DDP step time <= 1.03": False}


@pytest.mark.integration
def test_a_step_past_its_timeout_is_ended_with_every_process_it_started(tmp_path):
    """A step's grandchild in a session of its own (as a launcher starts etcd) is ended too."""
    pidfile = tmp_path / "pid"
    code = ("import subprocess, sys, time; "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            f"open({str(pidfile)!r}, 'w').write(str(g.pid)); print('{{\"x\": 1}}', flush=True); time.sleep(60)")
    seen: list[str] = []
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        rc, wall = gpu_run.run_step("slow", [sys.executable, "-c", code], 3, dict(os.environ), log, seen.append)
    assert rc == "timeout" and 3 <= wall < 15 and time.monotonic() - t0 < 15
    assert seen == ['{"x": 1}']
    grandchild = int(pidfile.read_text())
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{grandchild}") or open(f"/proc/{grandchild}/stat").read().split()[2] == "Z"
