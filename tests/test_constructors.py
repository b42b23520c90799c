"""No constructor in lightning_ft takes more than 10 parameters besides `self` (issue 26).

Every `__init__` of every class in the package (nested classes too) is read with `ast`, without
importing anything. Counted: the named parameters, positional-only, positional and keyword-only;
`*args` and `**kwargs` are not counted (`FTHSDPStrategy.__init__` forwards `**kwargs` to
Lightning's strategy, and that is fine). Dataclass fields are not constructors for this rule: a
frozen settings dataclass (`FTARSettings`, `MembershipSettings`, replica/settings.py's
`Settings`, ...) is how a constructor keeps its parameters few, so its generated `__init__` is
not checked (it has no `__init__` in the source to read).

A constructor that needs more: group its related settings into a small frozen dataclass that
validates impossible values in `__post_init__`, and keep the collaborators (stores, sockets,
callables) as explicit parameters (e.g. `FTAR(job, replica, rank, secret, FTARSettings(...))`).
"""
from __future__ import annotations

import ast
from pathlib import Path

import lightning_ft

MAX_PARAMS = 10
PACKAGE = Path(lightning_ft.__file__).parent


def constructor_params(init: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The named parameters of `init`, `self` excluded (*args and **kwargs not counted)."""
    a = init.args
    named = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    return named - 1 if named else 0


def constructors(root: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """(file relative to the repository, class, parameter count) of every `__init__` under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
                    out.append((str(path.relative_to(root.parent)), node.name, constructor_params(item)))
    return out


def test_the_walk_finds_the_package_constructors():
    found = {(f, c) for f, c, _ in constructors()}
    assert ("lightning_ft/ftar/engine.py", "FTAR") in found
    assert ("lightning_ft/coord/membership.py", "Membership") in found
    assert len(found) > 50


def test_counting_skips_self_and_star_parameters():
    src = ("class A:\n    def __init__(self, a, /, b, *args, c, d=1, **kwargs): ...\n"
           "class B:\n    def __init__(self): ...\n")
    inits = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)]
    assert [constructor_params(f) for f in inits] == [4, 0]


def test_no_constructor_takes_more_than_ten_parameters():
    over = [f"{cls} in {path}: {n} parameters" for path, cls, n in constructors() if n > MAX_PARAMS]
    assert not over, (f"constructors with more than {MAX_PARAMS} parameters besides self (group related settings "
                      f"into a frozen dataclass, as FTARSettings does; see this module's docstring):\n  "
                      + "\n  ".join(over))
