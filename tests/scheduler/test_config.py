"""The scheduler's config section and the tier manager's link to it."""

import pytest

from tierstack.config import load_config
from tierstack.errors import ConfigError


def test_defaults_and_overrides():
    config = load_config({"scheduler": {"replan_threshold": 0.3, "replan_after_seconds": 5},
                          "tier_manager": {"scheduler_address": "unix:/tmp/s.sock", "node_id": "n1"}})
    assert config.scheduler.replan_threshold == 0.3 and config.scheduler.replan_after_seconds == 5.0
    assert config.tier_manager.scheduler_address == "unix:/tmp/s.sock"
    assert load_config().tier_manager.scheduler_address == ""  # no scheduler unless asked


@pytest.mark.parametrize("bad,message", [
    ({"scheduler": {"replan_treshold": 0.3}}, "unknown config key scheduler.replan_treshold"),
    ({"scheduler": {"replan_threshold": 25}}, "scheduler.replan_threshold is a fraction"),
    ({"scheduler": {"report_interval_seconds": 0}}, "scheduler.report_interval_seconds must be positive"),
    ({"tier_manager": {"node_id": "a/b"}}, "tier_manager.node_id"),
])
def test_bad_values_name_their_key(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config(bad)
