"""How far one optimizer step reaches into our code: the functions, files and threads of
lightning_ft that a steady step of a Lightning job runs (issue "One protocol core...": before
and after the caller-driven step).

    python -m lightning_ft.bench.step_trace [--steps 30] [--at 20] [--tree PATH]

Runs `examples/train_lm.py` as 2 replicas x 1 process under `lightning-ft run` (fresh processes,
no zygote) with a profiler injected through `sitecustomize` (nothing in the package knows of
it). On replica 0's rank 0 it records every call into a lightning_ft function from the entry of the strategy's
`optimizer_step` number `--at` (a steady step: no failure, nobody joining) to the entry of the
next one, on every thread (the quorum thread's round included), and the deepest stack of
lightning_ft frames. `--tree` runs another checkout (e.g. a worktree of an older commit) with
this script, so that both are measured the same way. Prints one line:

    {"bench": "step_trace", "functions": N, "files": N, "threads": N, "max_depth": N, "by_file": {...}}
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

TRACER = textwrap.dedent('''
    import os, sys, threading, json
    _AT = int(os.environ.get("LFT_TRACE_AT", "0"))
    _OUT = os.environ.get("LFT_TRACE_OUT", "")
    _S = {"n": 0, "on": False, "calls": {}, "threads": set(), "depth": 0, "who": None}

    def _mine():  # per process: replicas are forked from a zygote that imported this too
        if _S["who"] is None or _S["who"][0] != os.getpid():
            _S["who"] = (os.getpid(), os.environ.get("LFT_REPLICA_ID") == "0" and os.environ.get("RANK", "0") == "0")
        return _S["who"][1]

    def _depth(frame):
        d = 0
        while frame is not None:
            if "lightning_ft" in frame.f_code.co_filename:
                d += 1
            frame = frame.f_back
        return d

    def _prof(frame, event, arg):
        if event != "call" or not _AT or not _mine():
            return
        code = frame.f_code
        fn = code.co_filename
        if "lightning_ft" not in fn:
            return
        if code.co_name == "optimizer_step" and fn.endswith(os.path.join("strategy", "stepping.py")):
            _S["n"] += 1
            if _S["n"] == _AT:
                _S["on"] = True
            elif _S["n"] == _AT + 1 and _S["on"]:
                _S["on"] = False
                rel = lambda f: f[f.rindex("lightning_ft"):]
                by_file = {}
                for (f, name), n in sorted(_S["calls"].items()):
                    by_file.setdefault(rel(f), []).append(name)
                with open(_OUT, "w") as out:
                    dirs = {}
                    for f, names in by_file.items():
                        d = f.split("/")[1] if f.count("/") > 1 else "."
                        dirs[d] = dirs.get(d, 0) + len(names)
                    json.dump({"functions": len(_S["calls"]), "files": len(by_file), "threads": sorted(_S["threads"]),
                               "functions_by_dir": dirs,
                               "max_depth": _S["depth"], "by_file": by_file}, out)
        if _S["on"]:
            key = (fn, code.co_name)
            _S["calls"][key] = _S["calls"].get(key, 0) + 1
            t = threading.current_thread()
            _S["threads"].add("main" if t is threading.main_thread() else t.name.rstrip("0123456789_-").split("-r")[0])
            _S["depth"] = max(_S["depth"], _depth(frame))

    if _AT:
        sys.setprofile(_prof)
        threading.setprofile(_prof)
''')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--at", type=int, default=20, help="the optimizer_step call to trace (a steady one)")
    p.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   help="the checkout whose lightning_ft and examples/train_lm.py run")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(TRACER)
        out = os.path.join(tmp, "trace.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, a.tree]), LFT_TRACE_AT=str(a.at),
                   LFT_TRACE_OUT=out, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--nproc-per-replica", "1",
               "--run-dir", os.path.join(tmp, "run"), os.path.join(a.tree, "examples", "train_lm.py"),
               "--steps", str(a.steps), "--val-every", "100000", "ft.supervisor.zygote=false"]
        proc = subprocess.run(cmd, env=env, cwd=a.tree, capture_output=True, text=True, timeout=a.timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            print(json.dumps({"bench": "step_trace", "error": f"exit {proc.returncode}, no trace"}))
            return 1
        with open(out) as f:
            got = json.load(f)
    print(json.dumps({"bench": "step_trace", "tree": a.tree, "at": a.at, **got}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
