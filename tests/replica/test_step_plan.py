"""Pure parts of a step's plan (replica/plan.py)."""
import math

import pytest

from lightning_ft.replica.plan import lr_factor


def test_lr_factor_modes():
    assert lr_factor("none", 2, 3) == 1.0
    assert lr_factor("linear", 2, 4) == 0.5
    assert lr_factor("sqrt", 2, 3) == math.sqrt(2 / 3)
    assert lr_factor("sqrt", 3, 3) == 1.0
    with pytest.raises(ValueError, match="not one of"):
        lr_factor("cube", 1, 2)
