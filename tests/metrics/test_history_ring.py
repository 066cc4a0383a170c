"""The node's bandwidth history ring: order, wrap-around, the window, its size limit."""

import pytest

from tierstack import metric_catalog as mc
from tierstack.config import ConfigError, MetricsConfig, load_config
from tierstack.dashboards.snapshots import HistorySample
from tierstack.services.tier_manager.history_ring import HistoryRing


def sample(t: float) -> HistorySample:
    return HistorySample(timestamp=t, links={link: t * (i + 1) for i, link in enumerate(mc.LINKS)},
                         tiers_used={tier: int(t) * 1000 + i for i, tier in enumerate(mc.TIERS)},
                         stall_seconds_per_second=t / 100)


def test_the_ring_keeps_the_last_samples_oldest_first_and_reads_them_back_whole():
    ring = HistoryRing(5)
    assert ring.since(0) == []
    for t in range(1, 13):  # wraps around twice
        ring.append(sample(float(t)))
    assert len(ring) == 5
    assert ring.since(0) == [sample(float(t)) for t in range(8, 13)]
    assert [s.timestamp for s in ring.since(10.0)] == [10.0, 11.0, 12.0]
    assert ring.since(13.0) == []


def test_a_history_larger_than_the_daemon_keeps_is_refused_in_one_line():
    assert MetricsConfig(history_seconds=900, sample_interval_seconds=1).history_samples == 901
    with pytest.raises(ConfigError, match="history_seconds / sample_interval_seconds .* shorten the history"):
        load_config({"tier_manager": {"metrics": {"history_seconds": 1e9}}})
