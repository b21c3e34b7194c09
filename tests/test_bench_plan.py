"""The planner validation benchmark's parts that need no ranks: its setups, its rank numbering
against the planner's, Kendall's tau, the memory tracker and the comparison (no timing is checked)."""
import argparse
from types import SimpleNamespace

import pytest
import torch

from braid.bench import plan as bench_plan
from braid.plan.cost import spans


def test_setups_parse_and_refuse():
    assert bench_plan.parse_setups("2x2:1000,4x1:0") == [(2, 2, 1000), (4, 1, 0)]
    assert bench_plan.parse_setups("1x4") == [(1, 4, 0)]
    for bad in ("2x3:1000", "2x2:-1", "two", "", "2x2:fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_plan.parse_setups(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown layout"):
        bench_plan.parse_layouts("ddp,zero4")


@pytest.mark.parametrize("layout", bench_plan.LAYOUTS, ids=bench_plan.LAYOUT_NAMES)
@pytest.mark.parametrize("per_host", [1, 2, 4])
def test_groups_are_the_planners(layout, per_host):
    """Each group the benchmark makes spans the hosts the planner charges it for (the mesh
    (pp, dp, cp, tp), tp fastest), and every group of a dimension partitions the ranks."""
    world = 4
    assert layout.dp * layout.tp * layout.pp * layout.cp == world
    want = spans(layout.tp, layout.cp, layout.dp, 1, layout.pp, per_host)
    for dims, key in ((("tp",), "tp"), (("cp",), "cp"), (("pp",), "pp"), (("dp", "cp"), "dense")):
        groups = bench_plan.group_members(layout, dims, world)
        assert sorted(r for g in groups for r in g) == list(range(world))
        size = 1
        for d in dims:
            size *= getattr(layout, d)
        assert all(len(g) == size for g in groups)
        for g in groups:
            hosts = {r // per_host for r in g}
            local = max(sum(1 for r in g if r // per_host == h) for h in hosts)
            assert (local, len(hosts)) == want[key], (dims, g)


def test_kendall_tau():
    assert bench_plan.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench_plan.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # 5 concordant and 1 discordant pair of 6: (5 - 1) / 6
    assert bench_plan.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # a tie in one sequence: tau-b's denominator sqrt((6 - 0) * (6 - 1))
    assert bench_plan.kendall_tau([1, 2, 3, 4], [1, 1, 3, 4]) == pytest.approx(5 / (6 * 5) ** 0.5)


def test_peak_memory_by_hand():
    """Roots count from the start; a temporary counts while it lives; resize_ moves the count."""
    root = torch.zeros(1000)  # 4,000 bytes
    with bench_plan.PeakMemory([root]) as tracker:
        a = torch.ones(2000)  # 8,000
        b = a * 2  # 8,000 more: 20,000 at once
        del a, b
        c = torch.ones(500)  # 2,000
        c.untyped_storage().resize_(0)
        d = torch.ones(100)  # 400
    assert tracker.peak == 4000 + 8000 + 8000
    assert tracker.current == 4000 + 0 + 400
    del c, d
    assert tracker.current == 4000  # freed after the block too: the count follows the storages


def test_compare_names_the_first_choice_and_the_best():
    def layout(step, total):
        return SimpleNamespace(step=step, memory=SimpleNamespace(total=total))

    measured = {"step": {"a": 1.0, "b": 2.0, "c": 3.0}, "peak": {"a": 100, "b": 100, "c": 100}}
    predicted = {"a": layout(2.0, 100), "b": layout(1.0, 110), "c": layout(3.0, 130)}
    c = bench_plan.compare(measured, predicted)
    assert c["first_choice"] == "b" and c["measured_best"] == "a"
    assert c["first_over_best"] == pytest.approx(2.0)
    assert c["kendall_tau"] == pytest.approx(1 / 3)
    assert c["memory_within_15"] == 2
