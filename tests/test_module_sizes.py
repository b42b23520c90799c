"""No module of lightning_ft has more than 500 lines (issue 26): a module that grows past it is
split by concept, as replica/ and bench/soak.py (soak_parts.py) were."""
from __future__ import annotations

from pathlib import Path

import lightning_ft

MAX_LINES = 500
PACKAGE = Path(lightning_ft.__file__).parent


def test_no_module_is_longer_than_500_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 100  # the walk found the package
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concept): {over}"
