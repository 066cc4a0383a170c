import json

import pytest

from tierstack.config import GiB, MiB, load_config, parse_size
from tierstack.errors import ConfigError


def test_defaults_load_and_validate():
    config = load_config()
    assert config.tier_manager.nvme_pool.aio.block_size == 1 * MiB
    assert config.tier_manager.cpu_pool.size == 2 * GiB


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * GiB), ("512MiB", 512 * MiB), ("1.5GB", 1_500_000_000), (4096, 4096), ("4096", 4096),
])
def test_sizes_are_read_with_units(text, expected):
    assert parse_size(text) == expected


def test_unknown_key_is_named_with_its_path():
    with pytest.raises(ConfigError, match=r"unknown config key tier_manager\.nvme_pool\.aio\.queue_dpth"):
        load_config({"tier_manager": {"nvme_pool": {"aio": {"queue_dpth": 8}}}})


@pytest.mark.parametrize("data,message", [
    ({"tier_manager": {"nvme_pool": {"aio": {"block_size": 1000}}}}, "block_size"),
    ({"tier_manager": {"cpu_pool": {"size": "lots"}}}, "cpu_pool.size"),
    ({"tier_manager": {"nvme_pool": {"paths": []}}}, "paths"),
    ({"tier_manager": {"nvme_pool": {"aio": {"thread_count": 0}}}}, "thread_count"),
    ({"tier_manager": {"cpu_pool": {"arena_size": "1000"}}}, "arena_size"),
])
def test_bad_values_name_the_setting(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(data)


def test_json_file_is_loaded(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tier_manager": {"cpu_pool": {"size": "64MiB"}}}))
    assert load_config(path).tier_manager.cpu_pool.size == 64 * MiB
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
