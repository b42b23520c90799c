"""What `import lightning_ft` does, and what the training path imports (issue 39, "Names and
layout that explain themselves")."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lightning_ft"
TOOLS = ("bench", "sim", "study")
"""What runs beside a job, never inside it: benchmarks, simulations, the study."""


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_training_path_never_imports_benchmarks_simulations_or_the_study():
    mods = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
                  for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in TOOLS and p.name != "__main__.py")
    assert "lightning_ft.strategy.ft_hsdp" in mods and "lightning_ft.launch.cli" in mods and len(mods) > 80
    got = _fresh(f"""
import importlib, json, sys
for m in {mods!r}:
    importlib.import_module(m)
from lightning_ft.launch.cli import build_parser
build_parser()
print(json.dumps(sorted(n for n in sys.modules if n.split(".")[:2][-1] in {TOOLS!r} and n.startswith("lightning_ft."))))
""")
    assert got == [], f"the training path imports {got}"


def test_import_lightning_ft_only_registers_the_strategy_name():
    got = _fresh("""
import json, sys
before = list(sys.meta_path)
import lightning_ft
added = [type(f).__name__ for f in sys.meta_path if f not in before]
mods = sorted(n for n in sys.modules if n.startswith("lightning_ft"))
import lightning.pytorch as L
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
print(json.dumps({"added": added, "mods": mods,
                  "left": [type(f).__name__ for f in sys.meta_path if f not in before],
                  "trainer": "ft_hsdp" in StrategyRegistry, "fabric": "ft_hsdp" in STRATEGY_REGISTRY}))
""")
    assert got["added"] == ["_RegisterOnImport"]  # one hook, until Lightning's registries load
    assert got["mods"] == ["lightning_ft"]  # nothing else of ours, and not torch through us
    assert "_RegisterOnImport" not in got["left"] and got["trainer"] and got["fabric"]  # it removed itself
