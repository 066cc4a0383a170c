"""The one budget type: stated budgets checked against the machine, 'auto' ones measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierstack.budgets import (HBM_MARGIN, HOST_FRACTION, HOST_OVERHEAD, Budgets, MachineLimits,
                               available_host_memory, default_budgets, free_space, measure)
from tierstack.config import load_config
from tierstack.errors import ConfigError

GiB = 1 << 30


def test_auto_budgets_are_the_machines_ceilings_less_margins():
    limits = MachineLimits(hbm=141 * GiB, host=100 * GiB, nvme=1000 * GiB)
    budgets = load_config({}).budgets.resolve(limits)
    assert budgets == default_budgets(limits)
    assert budgets.hbm == 141 * GiB - HBM_MARGIN
    assert budgets.host == int(100 * GiB * HOST_FRACTION)
    assert 900 * GiB < budgets.nvme < 1000 * GiB
    assert budgets.cpu_pool == budgets.host - HOST_OVERHEAD


def test_stated_budgets_are_kept_and_checked_against_the_machine():
    limits = MachineLimits(hbm=80 * GiB, host=64 * GiB, nvme=500 * GiB)
    stated = load_config({"budgets": {"hbm": "40GiB", "host": 16 * GiB, "nvme": "auto"}}).budgets
    budgets = stated.resolve(limits)
    assert (budgets.hbm, budgets.host) == (40 * GiB, 16 * GiB)
    too_much = load_config({"budgets": {"host": "65GiB"}}).budgets
    with pytest.raises(ConfigError, match=r"budgets.host is 65.0 GiB but available host memory .* "
                                          r"is 64.0 GiB; lower budgets.host to at most 64.0 GiB"):
        too_much.resolve(limits)


def test_bad_budget_values_name_the_key():
    with pytest.raises(ConfigError, match="budgets.hbm: cannot read 'lots' as a size"):
        load_config({"budgets": {"hbm": "lots"}})
    with pytest.raises(ConfigError, match="unknown config key budgets.ram"):
        load_config({"budgets": {"ram": "1GiB"}})
    with pytest.raises(ConfigError, match="budgets.nvme cannot be negative"):
        Budgets(hbm=0, host=0, nvme=-1)


def test_this_machine_is_measured(tmp_path: Path):
    limits = measure(tmp_path / "not" / "yet" / "there")  # the nearest existing parent counts
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert 0 < limits.host == available_host_memory() <= int(meminfo["MemAvailable"].split()[0]) * 1024
    # Other processes write to the same disk between the two readings.
    assert abs(limits.nvme - free_space(tmp_path)) < 256 << 20 and limits.nvme > 0
    two = measure([tmp_path, tmp_path / "b"], nvme_held=1 << 30)  # striped: 2 x the smaller
    assert abs(two.nvme - 2 * free_space(tmp_path) - (1 << 30)) < 512 << 20


def test_pool_caps_are_auto_or_stated_and_a_stated_cap_above_the_machine_is_refused():
    from tierstack.budgets import pool_caps
    limits = MachineLimits(hbm=0, host=10 * GiB, nvme=100 * GiB)
    caps = pool_caps("auto", "auto", limits)
    assert caps.cpu == default_budgets(limits).cpu_pool and caps.nvme == default_budgets(limits).nvme
    assert pool_caps(2 * GiB, 50 * GiB, limits).cpu == 2 * GiB
    with pytest.raises(ConfigError, match=r"tier_manager.cpu_pool.size is 11.0 GiB but available host "
                                          r"memory .* is 10.0 GiB; lower tier_manager.cpu_pool.size"):
        pool_caps(11 * GiB, "auto", limits)
    with pytest.raises(ConfigError, match="lower tier_manager.nvme_pool.size to at most 100.0 GiB"):
        pool_caps("auto", 101 * GiB, limits)
    with pytest.raises(ConfigError, match="the host budget leaves the CPU pool nothing"):
        pool_caps("auto", "auto", MachineLimits(hbm=0, host=GiB, nvme=GiB))


def test_stated_budgets_size_the_pools_that_say_auto():
    config = load_config({"budgets": {"host": "9GiB", "nvme": "100GiB"}})
    assert config.tier_manager.cpu_pool.size == 9 * GiB - HOST_OVERHEAD
    assert config.tier_manager.nvme_pool.size == 100 * GiB
    stated = load_config({"budgets": {"host": "9GiB"}, "tier_manager": {"cpu_pool": {"size": "1GiB"}}})
    assert stated.tier_manager.cpu_pool.size == GiB  # a stated pool size wins


def test_resolved_budgets_say_which_were_stated_and_which_measured():
    from tierstack.budgets import MachineLimits
    from tierstack.config import BudgetsConfig

    limits = MachineLimits(hbm=80 << 30, host=64 << 30, nvme=500 << 30)
    budgets = BudgetsConfig(host=8 << 30).resolve(limits)
    assert budgets.host == 8 << 30 and budgets.stated == {"host"}
    assert "host 8.0 GiB (stated)" in budgets.describe() and "hbm 78.0 GiB (measured)" in budgets.describe()
    assert budgets.with_(hbm=0).stated == {"host"}  # a change keeps where the others came from
