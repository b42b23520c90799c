"""The batch policy rule (lightning_ft/replica/batch_policy.py): which slot batches a train
round trains, who trains the absent slots', and the divisor; table-driven, then exhaustive
over every contributor set of R = 4, then a simulated job whose ledger must pass
verify_ledger."""
from __future__ import annotations

import itertools
import random

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica.batch_policy import round_batches
from lightning_ft.replica.ledger import read_cursors, record_commit, verify_ledger
from lightning_ft.replica.plan import lr_factor

CASES = [
    # policy, contributors, own cursors, R, slot cursors -> batches, extra, divisor
    ("shrink", (0, 1, 2, 3), {0: 5, 1: 5, 2: 5, 3: 5}, 4, (), {0: 5, 1: 5, 2: 5, 3: 5}, {}, 4),
    ("shrink", (0, 2), {0: 9, 2: 9}, 4, (), {0: 9, 2: 9}, {}, 2),
    ("shrink", (1, 3), {1: 4, 3: 7}, 4, (9, 4, 9, 7), {1: 4, 3: 7}, {}, 2),
    ("constant", (0, 1, 2, 3), {0: 5, 1: 5, 2: 5, 3: 5}, 4, (5, 5, 5, 5), {0: 5, 1: 5, 2: 5, 3: 5}, {}, 4),
    # one absent slot goes to the first contributor in ring order
    ("constant", (0, 1, 3), {0: 9, 1: 9, 3: 9}, 4, (9, 9, 6, 9), {0: 9, 1: 9, 2: 6, 3: 9}, {0: ((2, 6),)}, 4),
    # two absent slots: one each, in slot order
    ("constant", (1, 3), {1: 8, 3: 8}, 4, (5, 8, 6, 8), {0: 5, 1: 8, 2: 6, 3: 8}, {1: ((0, 5),), 3: ((2, 6),)}, 4),
    # three absent slots, one survivor: it trains all of them
    ("constant", (2,), {2: 3}, 4, (1, 2, 3, 0), {0: 1, 1: 2, 2: 3, 3: 0}, {2: ((0, 1), (1, 2), (3, 0))}, 4),
    # more absent slots than contributors: round-robin
    ("constant", (0, 4), {0: 2, 4: 2}, 5, (2, 1, 1, 0, 2), {0: 2, 1: 1, 2: 1, 3: 0, 4: 2},
     {0: ((1, 1), (3, 0)), 4: ((2, 1),)}, 5),
    # a contributor's own cursor is the one it reported, not the slot_cursors entry
    ("constant", (0, 1, 2), {0: 7, 1: 7, 2: 7}, 3, (7, 7, 7), {0: 7, 1: 7, 2: 7}, {}, 3),
]


@pytest.mark.parametrize("policy,contributors,cursors,R,slot_cursors,batches,extra,divisor", CASES)
def test_round_batches_table(policy, contributors, cursors, R, slot_cursors, batches, extra, divisor):
    rb = round_batches(policy, contributors, cursors, R, slot_cursors)
    assert dict(rb.batches) == batches
    assert {c: tuple(v) for c, v in rb.extra.items()} == extra
    assert rb.divisor == divisor
    for c in contributors:
        assert rb.extra_of(c) == extra.get(c, ())


def test_constant_without_every_slot_cursor_says_what_is_missing():
    with pytest.raises(ValueError, match=r"constant needs the cursors of all 4 slots .* absent slots \[2\]"):
        round_batches("constant", (0, 1, 3), {0: 1, 1: 1, 3: 1}, 4, ())
    with pytest.raises(ValueError, match="not one of shrink, constant"):
        round_batches("fixed", (0,), {0: 0}, 1)
    with pytest.raises(ValueError, match=r"contributors \[1\] have no cursor"):
        round_batches("shrink", (0, 1), {0: 0}, 2)


@pytest.mark.parametrize("n", range(1, 5))
def test_every_contributor_set_of_four(n):
    """Exhaustive over R = 4: constant trains every slot once, at its cursor, spread evenly;
    shrink trains exactly the contributors' slots; the LR factor sees divisor / R."""
    R = 4
    cur = (3, 1, 4, 2)
    for contributors in itertools.combinations(range(R), n):
        own = {c: cur[c] for c in contributors}
        shrink = round_batches("shrink", contributors, own, R, cur)
        assert dict(shrink.batches) == own and not shrink.extra and shrink.divisor == n
        const = round_batches("constant", contributors, own, R, cur)
        assert dict(const.batches) == dict(enumerate(cur)) and const.divisor == R
        trained = [s for c in contributors for s in [c] + [slot for slot, _ in const.extra_of(c)]]
        assert sorted(trained) == list(range(R))  # each slot by exactly one contributor
        loads = [1 + len(const.extra_of(c)) for c in contributors]
        assert max(loads) - min(loads) <= 1
        assert all(k == cur[s] for c in contributors for s, k in const.extra_of(c))
        assert lr_factor("sqrt", const.divisor, R) == 1.0
        assert lr_factor("linear", shrink.divisor, R) == n / R


@pytest.mark.parametrize("policy", ["shrink", "constant"])
def test_a_job_under_random_outages_keeps_the_ledger_exact(policy):
    """Replay the rule over 200 steps of random outages, advancing cursors as commits do
    (cursor of each listed slot = k + 1), recording every commit: verify_ledger finds no
    duplicate and no gap, and under constant every slot trained every step."""
    R, steps = 4, 200
    rng = random.Random(7)
    store, root = MemoryStore(), keys.root("/lft", "bp")
    cursors = [0] * R
    for step in range(steps):
        contributors = tuple(sorted(rng.sample(range(R), rng.randint(1, R))))
        rb = round_batches(policy, contributors, {c: cursors[c] for c in contributors}, R, tuple(cursors))
        for c in contributors:  # every committer records the same batches
            record_commit(store, root, step, c, epoch=0, round=step, batches=rb.batches)
        for s, k in rb.batches.items():
            cursors[s] = k + 1
    assert read_cursors(store, root, range(R)) == dict(enumerate(cursors))
    rep = verify_ledger(store, root)
    assert rep.ok and rep.steps == steps, (rep.duplicates, rep.gaps, rep.conflicts)
    if policy == "constant":
        assert cursors == [steps] * R
        assert all(rep.trained[s] == list(range(steps)) for s in range(R))
    else:
        assert sum(cursors) < steps * R
