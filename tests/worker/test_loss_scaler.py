"""fp16 loss scaling, update by update, against DeepSpeed's rules (DynamicLossScaler in
deepspeed/runtime/fp16/loss_scaler.py) worked out by hand here, and against those rules
restated in the test's own terms over a long random run."""

from __future__ import annotations

import random

import pytest
import torch

from tierstack.config import LossScaleConfig
from tierstack.worker.engine.loss_scaler import DynamicLossScaler, LossScaleUnderflowError, has_overflow

O, F = True, False  # an update with an overflow, a clean one


def _run(scaler: DynamicLossScaler, overflows: list[bool]) -> tuple[list[float], list[bool]]:
    """The scale after each update, and whether each step was applied."""
    scales, applied = [], []
    for overflow in overflows:
        applied.append(scaler.update(overflow))
        scales.append(scaler.scale)
    return scales, applied


def test_the_scale_starts_at_two_to_the_initial_power_and_doubles_after_each_clean_window():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3))
    assert scaler.scale == 16.0
    scales, applied = _run(scaler, [F] * 10)
    # DeepSpeed doubles when (updates since the last overflow) - 1 is a multiple of the
    # window: with no overflow yet, on the 4th, 7th and 10th update.
    assert scales == [16, 16, 16, 32, 32, 32, 64, 64, 64, 128]
    assert applied == [True] * 10


def test_hysteresis_absorbs_overflows_before_one_halves_the_scale():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=4, hysteresis=2))
    scales, applied = _run(scaler, [O, O, O, F, O])
    # The first overflow only skips its step; the second halves; with no rise in between,
    # every later one halves too, clean steps or not.
    assert scales == [16, 8, 4, 4, 2]
    assert applied == [False, False, False, True, False]


def test_without_consecutive_hysteresis_clean_steps_do_not_refill_it():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=4, hysteresis=2))
    assert _run(scaler, [O, F, F, O])[0] == [16, 16, 16, 8]


def test_consecutive_hysteresis_is_refilled_by_every_clean_step():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=4, hysteresis=2,
                                               consecutive_hysteresis=True))
    # Overflows apart never halve; two in a row do.
    assert _run(scaler, [O, F, O, F, O, O, O])[0] == [16, 16, 16, 16, 16, 8, 4]


def test_a_rise_refills_the_hysteresis_and_the_window_counts_from_the_last_overflow():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=2,
                                               hysteresis=2))
    # Overflow at update 0; clean updates 1 (0 since), 2 (1 since), 3 (2 since: doubles, and
    # refills the hysteresis), so the overflow at 4 is absorbed and the one at 5 halves.
    assert _run(scaler, [O, F, F, F, O, O, F, F, F])[0] == [16, 16, 16, 32, 32, 16, 16, 16, 32]


def test_hysteresis_one_halves_on_every_overflow_down_to_the_minimum_then_stops_training():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=3, hysteresis=1,
                                               min_loss_scale=1.5))
    assert _run(scaler, [O, O, O])[0] == [4, 2, 1.5]  # never below min_loss_scale
    with pytest.raises(LossScaleUnderflowError, match=r"smallest loss scale allowed \(1.5, "
                                                      r"fp16.min_loss_scale\)"):
        scaler.update(True)


def test_a_static_scale_never_moves_but_an_overflow_still_skips_its_step():
    scaler = DynamicLossScaler(LossScaleConfig(loss_scale=128.0, loss_scale_window=1))
    scales, applied = _run(scaler, [F, O, O, O, F, F])
    assert scales == [128.0] * 6
    assert applied == [True, False, False, False, True, True]


def _deepspeed_rules(config: LossScaleConfig, overflows: list[bool]) -> list[float]:
    """DeepSpeed's dynamic scaling restated: `clean` counts the clean updates since the last
    overflow; the one that makes it window + 1, 2 window + 1, ... doubles the scale."""
    scale, left, clean, out = 2.0 ** config.initial_scale_power, config.hysteresis, 0, []
    for overflow in overflows:
        if overflow:
            clean = 0
            if left > 1 and config.hysteresis > 1:
                left -= 1
            else:
                scale = max(scale / 2, config.min_loss_scale)
        else:
            clean += 1
            if config.consecutive_hysteresis:
                left = config.hysteresis
            if clean > 1 and (clean - 1) % config.loss_scale_window == 0:
                scale *= 2
                left = config.hysteresis
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis,consecutive,window", [(1, False, 5), (2, False, 3),
                                                           (3, True, 4), (4, False, 1)])
def test_a_long_random_run_follows_deepspeeds_rules(hysteresis, consecutive, window):
    config = LossScaleConfig(initial_scale_power=20, loss_scale_window=window,
                             hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                             min_loss_scale=1e-60)
    rng = random.Random(hysteresis * 100 + window)
    overflows = [rng.random() < 0.3 for _ in range(400)]
    scales, applied = _run(DynamicLossScaler(config), overflows)
    assert scales == _deepspeed_rules(config, overflows)
    assert applied == [not o for o in overflows]


def test_state_dict_round_trip_continues_the_same_run():
    config = LossScaleConfig(initial_scale_power=6, loss_scale_window=2, hysteresis=3)
    first, second = DynamicLossScaler(config), DynamicLossScaler(config)
    _run(first, [O, F, O, O, F, F, F, O])
    second.load_state_dict(first.state_dict())
    tail = [O, F, F, F, O, O, F, F, F, F]
    assert _run(second, tail) == _run(first, tail)


def test_has_overflow_finds_inf_and_nan_in_any_float_dtype():
    finite = [torch.ones(4), torch.full((3,), 65504.0, dtype=torch.float16),
              torch.ones(2, dtype=torch.bfloat16), None, torch.empty(0)]
    assert has_overflow(finite) is False and has_overflow([]) is False
    for bad in (float("inf"), -float("inf"), float("nan")):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            poisoned = torch.tensor([1.0, bad, 2.0], dtype=dtype)
            assert has_overflow([*finite, poisoned]) is True, (bad, dtype)
    # An fp16 gradient past fp16's range is inf already; one at its edge is not.
    assert has_overflow([torch.tensor([65504.0], dtype=torch.float16) * 2]) is True


def test_has_overflow_waits_on_the_device_once_not_per_tensor(monkeypatch):
    syncs = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: syncs.append(1) or real_bool(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("a sync per tensor"))
    assert has_overflow([torch.ones(8) for _ in range(20)]) is False
    assert len(syncs) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_has_overflow_on_cuda():
    grads = [torch.ones(1024, device="cuda", dtype=torch.float16) for _ in range(4)]
    assert has_overflow(grads) is False
    grads[2][7] = float("inf")
    assert has_overflow([*grads, torch.ones(3)]) is True
