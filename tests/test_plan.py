"""The plan rules (the AMSP paper's dependency rules between the factors) against
hand-enumerated worlds."""

import pytest

from amsp_dtensor.plan import BASELINES, ShardingPlan, enumerate_plans


def test_world4_two_per_node_has_the_nine_plans():
    names = [p.name for p in enumerate_plans(4, 2)]
    assert names == [
        "p1-g1-os1", "p1-g1-os2", "p1-g2-os2", "p1-g1-os4", "p1-g4-os4",
        "p2-g2-os2", "p2-g2-os4", "p2-g4-os4", "p4-g4-os4",
    ]


def test_world8_four_per_node_count():
    # factors {1,2,4,8}; pairs s_p | s_os: 10, of which 6 have s_p < s_os (two grad choices)
    assert len(enumerate_plans(8, 4)) == 16


def test_strategy_names_resolve():
    plan = ShardingPlan("node", "node", "full").resolve(16, 8)
    assert (plan.s_p, plan.s_g, plan.s_os) == (8, 8, 16)
    assert ShardingPlan("replica", "replica", "replica").resolve(16, 8).s_os == 1
    assert ShardingPlan("2", 2, "full").resolve(16, 8).s_p == 2


def test_two_dimensional_view():
    plan = ShardingPlan(2, 16, 16).resolve(32, 8)
    assert (plan.intra(plan.s_p), plan.inter(plan.s_p)) == (2, 1)
    assert (plan.intra(plan.s_os), plan.inter(plan.s_os)) == (8, 2)
    assert plan.mesh_shape == {"rep": 2, "p": 2, "g": 8, "os": 1}


def test_baselines_are_the_papers_tuples():
    resolved = {k: v.resolve(16, 8) for k, v in BASELINES.items()}
    assert [(p.s_p, p.s_g, p.s_os) for p in resolved.values()] == [
        (1, 1, 1), (1, 1, 16), (1, 16, 16), (16, 16, 16), (8, 8, 8)
    ]


@pytest.mark.parametrize(
    "plan, world, per_node, rule",
    [
        ((2, 1, 4), 4, 2, "param <= grad <= optim"),
        ((1, 2, 4), 8, 4, "grad follows param or optim"),
        ((3, 3, 3), 12, 4, "divides the node"),
        ((6, 6, 6), 12, 4, "fill a node"),
        ((5, 5, 5), 8, 4, "factor divides world"),
        ((2, 3, 6), 12, 6, "nested factors"),
    ],
)
def test_broken_rules_are_named(plan, world, per_node, rule):
    with pytest.raises(ValueError, match=rule) as err:
        ShardingPlan(*plan).resolve(world, per_node)
    assert "nearest valid plan" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        (dict(param="half"), ValueError, "not a strategy"),
        (dict(param=0), ValueError, "positive"),
        (dict(optim=2.5), TypeError, "int factor"),
        (dict(grad=True), TypeError, "int factor"),
    ],
)
def test_bad_factor_values(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        ShardingPlan(**kwargs).resolve(8, 4)


def test_bad_world():
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        ShardingPlan().resolve(6, 4)
    with pytest.raises(ValueError, match="positive int"):
        ShardingPlan().resolve(0, 4)


def test_nearest_valid_plan_is_itself_valid():
    with pytest.raises(ValueError) as err:
        ShardingPlan(4, 2, 8).resolve(8, 4)
    msg = str(err.value)
    nearest = msg.split("nearest valid plan: ")[1]
    vals = dict(kv.split("=") for kv in nearest.split(", "))
    ShardingPlan(int(vals["param"]), int(vals["grad"]), int(vals["optim"])).resolve(8, 4)


def test_plan_names_round_trip():
    for plan in enumerate_plans(8, 4):
        assert ShardingPlan.from_name(plan.name).resolve(8, 4) == plan
    assert ShardingPlan.from_name(" 2-2-4 ") == ShardingPlan(2, 2, 4)
    for bad in ("p2-g2", "p2-g2-os4-x", "pa-g2-os4", ""):
        with pytest.raises(ValueError, match="write it as p<s_p>-g<s_g>-os<s_os>"):
            ShardingPlan.from_name(bad)
