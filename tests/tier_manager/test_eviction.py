"""The eviction policy on its own: which CPU-resident key goes first, rule by rule."""

from __future__ import annotations

import pytest

from tierstack.errors import InvalidArgumentError
from tierstack.services.tier_manager.eviction import EvictionPolicy, JobPlan


def policy_with(*keys: str) -> EvictionPolicy:
    """A policy holding `keys` as CPU-resident, used in that order (oldest first)."""
    policy = EvictionPolicy()
    for key in keys:
        policy.touch(key)
    return policy


def auto(key: str) -> str:
    return "auto"


def test_without_plans_or_order_the_least_recently_used_goes():
    policy = policy_with("a", "b", "c")
    assert policy.victim(auto) == "a"
    policy.touch("a")
    assert policy.victim(auto) == "b"


def test_a_cpu_placement_is_never_evicted_and_nvme_goes_before_auto():
    policy = policy_with("pinned-by-user", "auto", "streamed")
    placements = {"pinned-by-user": "cpu", "auto": "auto", "streamed": "nvme"}
    # The plan would keep "streamed" and stream "pinned-by-user": the user's placement wins.
    policy.apply_plan(JobPlan("job", 1, {"pinned-by-user": "nvme", "streamed": "cpu"}))
    assert policy.victim(placements.get) == "streamed"
    placements["streamed"] = None  # being read: cannot go now
    assert policy.victim(placements.get) == "auto"
    placements["auto"] = None
    assert policy.victim(placements.get) is None  # only a "cpu" placement is left


def test_plan_nvme_goes_first_then_unplanned_keys_then_plan_cpu_and_gpu():
    policy = policy_with("kept", "on-device", "free", "streamed")  # "kept" is the oldest
    policy.apply_plan(JobPlan("job", 1, {"kept": "cpu", "on-device": "gpu", "streamed": "nvme"}))
    left = {"kept", "on-device", "free", "streamed"}
    order = []
    while left:
        key = policy.victim(lambda k: "auto" if k in left else None)
        order.append(key)
        left.discard(key)
    # A plan's CPU (or device) tier is a preference, not a pin: those keys still go last.
    assert order[:2] == ["streamed", "free"] and set(order[2:]) == {"kept", "on-device"}


def test_within_a_rank_next_use_decides_then_the_plan_order_then_recency():
    policy = policy_with("l0", "l1", "l2", "l3")
    policy.set_access_order(["l0", "l1", "l2", "l3"])
    for key in ("l0", "l1", "l2", "l3"):
        policy.touch(key)  # a sweep: the cursor is after l3, l0 comes next
    policy.apply_plan(JobPlan("job", 1, {k: "cpu" for k in ("l0", "l1", "l2", "l3")},
                              eviction_order=["l0", "l1", "l2", "l3"]))
    # l3 is used furthest in the future; the plan's order would say l0, but next use wins.
    assert policy.victim(auto) == "l3"

    outside = policy_with("x", "y", "z")  # no access order: every distance ties
    outside.apply_plan(JobPlan("job", 1, {"x": "cpu", "y": "cpu", "z": "cpu"},
                               eviction_order=["z", "y"]))
    assert outside.victim(auto) == "z"  # the plan's order breaks the tie...
    assert outside.victim(lambda k: None if k == "z" else "auto") == "y"
    # ...and a key it does not list comes after those it lists.
    assert outside.victim(lambda k: "auto" if k == "x" else None) == "x"


def test_a_newer_plan_replaces_the_old_and_forgetting_falls_back_to_no_plan():
    policy = policy_with("other/c", "job/a", "job/b")  # other/c is the oldest
    policy.apply_plan(JobPlan("job", 1, {"job/a": "cpu", "job/b": "nvme"}))
    policy.apply_plan(JobPlan("other", 4, {"other/c": "cpu"}))
    assert policy.victim(auto) == "job/b"
    policy.apply_plan(JobPlan("job", 2, {"job/b": "cpu"}))  # job/a is in no plan now
    assert policy.victim(auto) == "job/a"
    assert [(p.job, p.version) for p in policy.state().plans] == [("job", 2), ("other", 4)]
    policy.forget_plan("job")
    # job/a and job/b have no plan now (the middle rank); other/c keeps its CPU tier.
    assert policy.victim(lambda k: None if k == "job/a" else "auto") == "job/b"
    assert [p.job for p in policy.state().plans] == ["other"]
    policy.forget_plan("never-planned")  # nothing to forget: no error


def test_residency_bookkeeping_untrack_and_requeue_first():
    policy = policy_with("a", "b", "c")
    policy.untrack("a")  # being evicted: not a candidate
    assert policy.victim(auto) == "b"
    policy.requeue_first("a")  # its eviction failed: first in line again
    assert policy.victim(auto) == "a"
    policy.requeue_first("c")  # still tracked: stays where it is
    assert policy.victim(lambda k: None if k == "a" else "auto") == "b"


def test_a_plan_with_an_unknown_tier_is_refused_with_the_tier_named():
    policy = EvictionPolicy()
    with pytest.raises(InvalidArgumentError, match="'tape'.*gpu, cpu, nvme"):
        policy.apply_plan(JobPlan("job", 1, {"job/a": "tape"}))
    with pytest.raises(InvalidArgumentError, match="job's name"):
        policy.apply_plan(JobPlan("", 1, {}))
    assert policy.state().plans == []


def test_state_counts_access_orders_and_names_the_rules_in_effect():
    policy = EvictionPolicy()
    state = policy.state()
    assert (state.access_order_version, state.access_order_keys, state.access_order_updated_at) == (0, 0, None)
    assert state.rules == "placement (nvme first, cpu never), then least recently used"
    policy.set_access_order(["a", "b", "b", "a"])
    policy.set_access_order(["a", "b", "c", "c", "b", "a"])
    policy.apply_plan(JobPlan("job", 3, {"a": "cpu", "b": "nvme"}, reason="trace"))
    state = policy.state()
    assert (state.access_order_version, state.access_order_keys) == (2, 6)
    [plan] = state.plans
    assert (plan.job, plan.version, plan.reason, plan.tensor_keys) == ("job", 3, "trace", 2)
    assert state.rules == ("placement (nvme first, cpu never), then the scheduler's plan tiers "
                           "(nvme first), then furthest next use in the access order, then the "
                           "plan's eviction order, then least recently used")
