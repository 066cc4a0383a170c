"""DeepSpeed's learning-rate schedules, value by value: the expected lrs below are
DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py) written out again here, and a few
worked by hand, checked at every iteration through warmup, decay and past the end."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tierstack.config import LRScheduleConfig, load_config
from tierstack.errors import ConfigError
from tierstack.lr_schedules import (OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                                    build_schedule, schedule_for_cli)


def _optimizer(*lrs: float) -> torch.optim.AdamW:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, betas=(0.9, 0.999))


def _lrs_by_iteration(schedule, optimizer, last: int) -> dict[int, list[float]]:
    """The groups' lrs at iteration -1 (construction) and after each step() up to `last`."""
    seen = {-1: [g["lr"] for g in optimizer.param_groups]}
    for iteration in range(last + 1):
        schedule.step()
        assert schedule.last_batch_iteration == iteration
        seen[iteration] = [g["lr"] for g in optimizer.param_groups]
        assert schedule.get_last_lr() == seen[iteration]
    return seen


def _warmup_gamma(i: int, steps: int, kind: str) -> float:
    """DeepSpeed's warmup fraction at iteration i (warmup_num_steps counts as at least 2)."""
    steps = max(2, steps)
    return math.log(i + 1) / math.log(steps) if kind == "log" else i / steps


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_rises_from_min_to_max_then_holds(kind):
    opt = _optimizer(0.5)
    schedule = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5,
                        warmup_type=kind)
    seen = _lrs_by_iteration(schedule, opt, 9)
    assert seen[-1] == [0.01]  # set when made: DeepSpeed's iteration -1 is the min lr
    for i in range(10):
        gamma = _warmup_gamma(i, 5, kind) if i < 5 else 1.0
        assert seen[i][0] == pytest.approx(0.01 + 0.09 * gamma, rel=1e-12), i


def test_linear_warmup_worked_by_hand():
    opt = _optimizer(1.0)
    seen = _lrs_by_iteration(WarmupLR(opt, 0.0, 0.1, 4, "linear"), opt, 5)
    assert [seen[i][0] for i in range(-1, 6)] == pytest.approx([0, 0, 0.025, 0.05, 0.075, 0.1, 0.1])


def test_warmup_num_steps_of_one_counts_as_two():
    opt = _optimizer(1.0)
    seen = _lrs_by_iteration(WarmupLR(opt, 0.0, 0.1, 1, "linear"), opt, 3)
    assert [seen[i][0] for i in range(4)] == pytest.approx([0, 0.05, 0.1, 0.1])
    # log warmup over (at least) 2 steps: ln(i + 1) / ln(2)
    opt = _optimizer(1.0)
    seen = _lrs_by_iteration(WarmupLR(opt, 0.0, 0.1, 1, "log"), opt, 2)
    assert [seen[i][0] for i in range(3)] == pytest.approx([0, 0.1, 0.1])


def test_warmup_lr_without_max_warms_each_group_to_its_own_lr():
    opt = _optimizer(0.1, 0.3)
    seen = _lrs_by_iteration(WarmupLR(opt, warmup_num_steps=4, warmup_type="linear"), opt, 5)
    assert seen[-1] == [0.0, 0.0]
    assert seen[2] == pytest.approx([0.05, 0.15]) and seen[5] == pytest.approx([0.1, 0.3])


def test_per_group_lists_give_each_group_its_own_bounds():
    opt = _optimizer(1.0, 1.0)
    schedule = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.2],
                        warmup_num_steps=10, warmup_type="log")
    seen = _lrs_by_iteration(schedule, opt, 12)
    for i in range(13):
        gamma = _warmup_gamma(i, 10, "log") if i < 10 else 1.0
        assert seen[i] == pytest.approx([0.1 * gamma, 0.01 + 0.19 * gamma], rel=1e-12), i
    with pytest.raises(ConfigError, match=r"^WarmupLR.warmup_max_lr: 3 values for 2 param groups"):
        WarmupLR(_optimizer(1.0, 1.0), warmup_max_lr=[0.1, 0.2, 0.3])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_decays_linearly_to_the_min_lr_at_total_steps(kind):
    total, warmup, low, high = 10, 4, 0.001, 0.1
    opt = _optimizer(0.5, 0.5)
    schedule = WarmupDecayLR(opt, total, warmup_min_lr=[low, 0.0], warmup_max_lr=[high, 0.2],
                             warmup_num_steps=warmup, warmup_type=kind)
    seen = _lrs_by_iteration(schedule, opt, 14)
    assert seen[-1] == [low, 0.0]
    for i in range(15):
        if i < warmup:
            gamma = _warmup_gamma(i, warmup, kind)
        else:
            gamma = max(0.0, (total - i) / max(1.0, total - warmup))
        assert seen[i] == pytest.approx([low + (high - low) * gamma, 0.2 * gamma], rel=1e-12), i
    assert seen[5][1] == pytest.approx(0.2 * 5 / 6) and seen[10] == [low, 0.0] == seen[14]


def test_warmup_decay_lr_defaults_to_deepspeeds_max_of_0_001():
    opt = _optimizer(0.5)
    seen = _lrs_by_iteration(WarmupDecayLR(opt, 100, warmup_num_steps=2, warmup_type="linear"), opt, 2)
    assert seen[2] == pytest.approx([0.001])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_scales_each_groups_lr(kind):
    total, warmup, start, floor = 10, 4, 0.1, 0.05
    opt = _optimizer(0.2, 0.4)
    schedule = WarmupCosineLR(opt, total, warmup_min_ratio=start, warmup_num_steps=warmup,
                              cos_min_ratio=floor, warmup_type=kind)
    seen = _lrs_by_iteration(schedule, opt, 16)
    assert seen[-1] == [0.0, 0.0]  # DeepSpeed's iteration -1 is lr 0, whatever the ratios
    for i in range(17):
        if i < warmup:
            ratio = start + _warmup_gamma(i, warmup, kind) * (1 - start)
        else:
            progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))
            ratio = floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
        assert seen[i] == pytest.approx([0.2 * ratio, 0.4 * ratio], rel=1e-12), i
    # By hand: the first iteration is the start ratio; from the end on, the floor.
    assert seen[0] == pytest.approx([0.02, 0.04])
    assert seen[9] == pytest.approx([0.01, 0.02]) == seen[16]


def _one_cycle_expected(i, low, high, first, second, decay_step, lr_rate, mom_low, mom_high,
                        mom_rate):
    """DeepSpeed's OneCycle at iteration i, without stairs: (lr, beta1)."""
    total = first + second
    if i >= total:
        interval = (i - total + 1) / decay_step
        return low / (1 + lr_rate * interval), mom_high * (1 + mom_rate * interval)
    batch = i + 1
    x = 1 + batch / total - math.floor(1 + batch / total)
    ratio = first / total
    scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
    return low + (high - low) * scale, mom_high - (mom_high - mom_low) * scale


def test_one_cycle_lr_and_momentum_over_an_asymmetric_cycle_and_its_decay():
    opt = _optimizer(1.0)
    schedule = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5,
                        cycle_first_step_size=4, cycle_second_step_size=6, decay_step_size=2,
                        cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.1)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.85, 0.99)
    for i in range(16):
        schedule.step()
        lr, beta1 = _one_cycle_expected(i, 0.01, 0.1, 4, 6, 2, 0.5, 0.85, 0.95, 0.1)
        group = opt.param_groups[0]
        assert group["lr"] == pytest.approx(lr, rel=1e-12), i
        # DeepSpeed sets (beta1, 0.99): its 0.99 replaces the optimizer's beta2 of 0.999.
        assert group["betas"][0] == pytest.approx(beta1, rel=1e-12) and group["betas"][1] == 0.99
    # By hand: iteration 0 is a quarter of the way up, 3 the peak, 8 a sixth of the way down.
    check = OneCycle(_optimizer(1.0), 0.01, 0.1, cycle_first_step_size=4, cycle_second_step_size=6)
    got = {}
    for i in range(10):
        check.step()
        got[i] = check.get_last_lr()[0]
    assert (got[0], got[3], got[8], got[9]) == pytest.approx((0.0325, 0.1, 0.025, 0.01))


def test_one_cycle_without_decay_holds_the_min_lr_and_max_momentum_after_the_cycle():
    opt = _optimizer(1.0)
    schedule = OneCycle(opt, 0.01, 0.1, decay_lr_rate=0.5, cycle_first_step_size=2)
    for _ in range(8):  # decay_step_size 0: no decay whatever the rates
        schedule.step()
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.99)


def test_one_cycle_stairs_hold_the_lr_flat_between_stair_edges():
    opt = _optimizer(1.0)
    schedule = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_second_step_size=6,
                        cycle_first_stair_count=2, cycle_second_stair_count=3,
                        cycle_momentum=False)
    seen = _lrs_by_iteration(schedule, opt, 9)
    # Batch b = i + 1 of the cycle: up in 2 stairs over 4 batches, down in 3 over 6.
    expected = {0: 0.0, 1: 0.5, 2: 0.5, 3: 1.0, 4: 2 / 3, 5: 2 / 3, 6: 1 / 3, 7: 1 / 3, 8: 0.0, 9: 0.0}
    assert {i: seen[i][0] for i in expected} == pytest.approx(expected)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # cycle_momentum off: untouched


def test_one_cycle_per_group_lists_and_an_optimizer_without_betas(caplog):
    opt = _optimizer(1.0, 1.0)
    schedule = OneCycle(opt, [0.01, 0.02], [0.1, 0.4], cycle_first_step_size=2,
                        cycle_min_mom=[0.8, 0.7], cycle_max_mom=[0.9, 0.95])
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.7, 0.99)]
    schedule.step()  # iteration 0: half way up (batch 1 of a 2-batch rise)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.055, 0.21])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.85, 0.825])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.5)
    with caplog.at_level(logging.WARNING, logger="tierstack.lr_schedules"):
        OneCycle(sgd, 0.01, 0.1).step()
    assert "cycle_momentum is off" in caplog.text and sgd.param_groups[0]["momentum"] == 0.5


def test_any_object_with_param_groups_is_driven_and_a_tensor_lr_is_filled_in_place():
    class Engine:
        param_groups = [{"lr": 1.0}, {"lr": torch.tensor(1.0)}]

    engine = Engine()
    tensor_lr = engine.param_groups[1]["lr"]
    schedule = WarmupLR(engine, 0.0, 0.1, 4, "linear")
    schedule.step(2)  # jump to iteration 2
    assert engine.param_groups[0]["lr"] == pytest.approx(0.05)
    assert engine.param_groups[1]["lr"] is tensor_lr and float(tensor_lr) == pytest.approx(0.05)
    with pytest.raises(Exception, match="param_groups"):
        WarmupLR(object())


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, 0.0, 0.1, 5, "log"),
    lambda o: WarmupDecayLR(o, 12, 0.0, 0.1, 5, "linear"),
    lambda o: WarmupCosineLR(o, 12, 0.1, 5, 0.01, "linear"),
    lambda o: OneCycle(o, 0.01, 0.1, 0.2, 3, 4, decay_step_size=2, decay_mom_rate=0.1),
])
def test_state_dict_round_trip_resumes_at_the_same_lr(make):
    opt = _optimizer(0.2, 0.3)
    schedule = make(opt)
    for _ in range(7):
        schedule.step()
    state = schedule.state_dict()
    assert state == {"last_batch_iteration": 6}  # DeepSpeed's format
    fresh_opt = _optimizer(0.2, 0.3)
    fresh = make(fresh_opt)
    fresh.load_state_dict(state)  # sets the groups for iteration 6 without the optimizer's state
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    assert [g["betas"] for g in fresh_opt.param_groups] == [g["betas"] for g in opt.param_groups]
    for _ in range(8):
        schedule.step()
        fresh.step()
        assert fresh.get_last_lr() == schedule.get_last_lr()


def _load_schedule(schedule: dict):
    return load_config({"train": {"lr_schedule": schedule}}).train.lr_schedule


@pytest.mark.parametrize("schedule,message", [
    ({"type": "WarmupLr"}, r"^train.lr_schedule.type: 'WarmupLr' is not a learning-rate schedule.*"
                           r"did you mean WarmupLR\?"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 3}},
     r"^unknown config key train.lr_schedule.params.warmup_num_step .*did you mean "
     r"train.lr_schedule.params.warmup_num_steps\?"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
     r"^train.lr_schedule.params.warmup_num_steps: expected an integer >= 1, got 0"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}, r"warmup_num_steps: expected an integer"),
    ({"type": "WarmupLR", "params": {"warmup_type": "exp"}},
     r"^train.lr_schedule.params.warmup_type: 'exp' is not one of log, linear"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "high"}}, r"params.warmup_max_lr: expected a number"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": -1}}, r"params.warmup_min_lr: must be >= 0"),
    ({"type": "WarmupDecayLR", "params": {}}, r"^train.lr_schedule.params.total_num_steps: "
                                              r"WarmupDecayLR needs it"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": True}},
     r"params.cos_min_ratio: expected a number, got True"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, r"params.cycle_max_lr: OneCycle needs it"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}},
     r"params.cycle_first_step_size: must be positive"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.2}},
     r"params.cycle_max_mom: a momentum \(Adam's beta1\) is in \[0, 1\)"),
    ({"type": "none", "params": {"warmup_num_steps": 3}}, r"^train.lr_schedule.params: given, but"),
    ({"type": "WarmupLR", "params": []}, r"^train.lr_schedule.params: expected an object"),
])
def test_bad_schedule_config_is_refused_naming_the_key(schedule, message):
    with pytest.raises(ConfigError, match=message):
        _load_schedule(schedule)


def test_bad_arguments_to_a_class_name_the_class_and_argument():
    with pytest.raises(ConfigError, match=r"^WarmupLR.warmup_num_steps: expected an integer >= 1, got 0"):
        WarmupLR(_optimizer(1.0), warmup_num_steps=0)
    with pytest.raises(ConfigError, match=r"^WarmupDecayLR.warmup_type: 'cos' is not one of"):
        WarmupDecayLR(_optimizer(1.0), 10, warmup_type="cos")
    with pytest.raises(ConfigError, match=r"^WarmupCosineLR.total_num_steps: expected an integer"):
        WarmupCosineLR(_optimizer(1.0), 0)


def test_a_config_schedule_builds_and_a_json_count_written_1e3_is_an_integer():
    config = _load_schedule({"type": "WarmupDecayLR", "params": {
        "total_num_steps": 1e3, "warmup_num_steps": 1e2, "warmup_max_lr": 0.01,
        "warmup_type": "linear"}})
    opt = _optimizer(1.0)
    schedule = build_schedule(opt, config)
    assert isinstance(schedule, WarmupDecayLR) and schedule.total_num_steps == 1000
    schedule.step(50)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    assert build_schedule(opt, LRScheduleConfig()) is None


def test_cli_schedules():
    def lrs(config, steps, optimizer_lr=123.0):
        opt = _optimizer(optimizer_lr)  # WarmupLR's and WarmupDecayLR's own lr wins
        schedule = build_schedule(opt, config)
        out = [opt.param_groups[0]["lr"]]
        for _ in range(steps):
            schedule.step()
            out.append(opt.param_groups[0]["lr"])
        return out  # out[k] is iteration k - 1

    assert lrs(schedule_for_cli("constant", 0.1, 4, 100), 7) == pytest.approx(
        [0, 0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    assert lrs(schedule_for_cli("constant", 0.1, 0, 100), 3) == pytest.approx([0.1] * 4)
    linear = lrs(schedule_for_cli("linear", 0.1, 2, 10), 12)
    assert linear[1:5] == pytest.approx([0, 0.05, 0.1, 0.1 * 7 / 8])
    assert linear[11] == 0 == linear[12]  # iteration 10 = total_steps: 0
    # WarmupCosineLR scales the optimizer's lr, which the CLI sets to --lr as well.
    cosine = lrs(schedule_for_cli("cosine", 0.1, 2, 10), 12, optimizer_lr=0.1)
    assert cosine[1:3] == pytest.approx([0, 0.05])
    assert cosine[3] == pytest.approx(0.1 * (1 + math.cos(math.pi / 8)) / 2)
    assert cosine[10] == pytest.approx(0.0, abs=1e-15) == cosine[12]  # ends at 0
    with pytest.raises(ConfigError, match=r"^--lr-schedule: 'step' is not one of constant, linear, cosine"):
        schedule_for_cli("step", 0.1, 0, 10)
    with pytest.raises(ConfigError, match=r"^--warmup-steps 20 is more than the run's 10 steps"):
        schedule_for_cli("linear", 0.1, 20, 10)
    with pytest.raises(ConfigError, match=r"^--lr: the learning rate must be a positive number"):
        schedule_for_cli("constant", 0.0, 0, 10)
