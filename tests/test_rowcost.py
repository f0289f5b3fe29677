"""The batch's n-gram node budget (rowcost.RowCost): the cost line fitted from forwards, acceptance by depth, and
the rule that gives a node out only while its acceptance beats its row's cost in tokens."""

from __future__ import annotations

import pytest

from swiftdecode.rowcost import RowCost


def fitted(a: float, b: float, rows=(1, 2, 4, 8, 12, 16)) -> RowCost:
    costs = RowCost()
    for _ in range(5):
        for r in rows:
            costs.record_forward(r, a + b * r)
    return costs


def test_line_recovers_the_cost_of_a_row():
    a, b = fitted(0.010, 0.0012).line()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.0012)


def test_no_slope_until_rows_vary():
    costs = RowCost()
    for _ in range(10):
        costs.record_forward(8, 0.02)
    assert costs.line() is None
    assert costs.budget(8, cap=3) == 3  # nodes are given out so that rows vary and the slope can be measured


def test_acceptance_by_depth():
    costs = RowCost()
    for _ in range(300):
        costs.record_tree(proposed=3, accepted=1)
    assert costs.accept(1) > 0.95 and costs.accept(2) < 0.05 and costs.accept(3) < 0.05
    assert costs.accept(5) == pytest.approx(0.5)  # never proposed: the prior


def test_budget_weighs_acceptance_against_the_row_cost():
    cheap, steep = fitted(0.010, 0.0005), fitted(0.010, 0.0022)  # a row costs 5% / 22% of the weights' pass
    for costs in (cheap, steep):
        for _ in range(300):
            costs.record_tree(proposed=4, accepted=2)  # depths 1-2 always accepted, 3-4 never
    assert cheap.budget(1, cap=15) == 2  # alone: the accepted depths pay, the rejected ones do not
    assert steep.budget(1, cap=15) == 2
    # 8 requests: a round already yields 8 tokens, a row costs 0.0022 s against 0.0032 s a token: still pays at
    # acceptance ~1; at acceptance 0.6 it would not
    assert steep.budget(8, cap=1) == 1
    for _ in range(300):
        steep.record_tree(proposed=1, accepted=0)
        steep.record_tree(proposed=1, accepted=1)
    assert 0.4 < steep.accept(1) < 0.8
    assert steep.budget(8, cap=1) == 0
    assert cheap.budget(8, cap=1) == 1  # a cheap row still pays at that acceptance
