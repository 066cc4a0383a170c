"""deploy/cluster.yaml and its local variant, checked with Ray's own cluster-config validator."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMMANDS = ("setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def ray_schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_ray_accepts_the_cluster_config(name):
    config = load(name)
    jsonschema.validate(config, ray_schema())  # the file as written, against Ray's schema
    validate_config(prepare_config(config))    # as `ray up` fills it out, by Ray's validator


def test_ray_rejects_a_broken_config():
    """The validator is real: a misspelt key is an error."""
    config = load("cluster.yaml")
    config["head_start_ray_comands"] = config.pop("head_start_ray_commands")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))
    config = load("cluster.yaml")
    config["available_node_types"]["head"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


def test_local_variant_runs_the_same_commands():
    aws, local = load("cluster.yaml"), load("cluster-local.yaml")
    for key in COMMANDS:
        assert local[key] == aws[key], key
    assert local["provider"]["type"] == "local" and aws["provider"]["type"] == "aws"


def test_start_commands_are_safe_on_a_shared_host():
    """Login shells over SSH: absolute paths, detached daemons, and never `ray stop`."""
    config = load("cluster.yaml")
    start = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    for command in start:
        assert "ray stop" not in command
        assert "</dev/null" in command, command          # no daemon holds the SSH session's stdin
        assert "${TIERSTACK_HOME:-$HOME/tierstack}/" in command  # never a bare `ray` from PATH
    head = " ".join(config["head_start_ray_commands"])
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert "start-node-services.sh\" head" in head
    assert "start-node-services.sh\" worker" in " ".join(config["worker_start_ray_commands"])
    script = (DEPLOY / "start-node-services.sh").read_text()
    assert "</dev/null >" in script and "setsid" in script


def test_node_services_name_their_cluster_by_its_ray_port():
    """The services' Ray address (which scopes them to this cluster) uses the head's port."""
    config = load("cluster.yaml")
    head, worker = config["head_start_ray_commands"], config["worker_start_ray_commands"]
    port = re.search(r"--port=(\d+)", head[0]).group(1)
    assert f"--address=$RAY_HEAD_IP:{port}" in worker[0]
    assert head[1].removesuffix(" </dev/null").endswith(f"cut -d' ' -f3):{port}\"")
    assert worker[1].removesuffix(" </dev/null").endswith(f"\"$RAY_HEAD_IP:{port}\"")


def test_every_node_type_is_a_valid_aws_node():
    config = copy.deepcopy(load("cluster.yaml"))
    prepared = prepare_config(config)
    assert set(prepared["available_node_types"]) == {"head", "gpu_worker"}
    assert prepared["head_node_type"] == "head"
    assert prepared["available_node_types"]["gpu_worker"]["max_workers"] <= prepared["max_workers"]


def test_every_ray_start_uses_the_clusters_token():
    """Ray's token auth on, explicitly, with the one token the checkout carries to every node
    (a head started with RAY_AUTH_MODE unset would turn it on by ~/.ray/auth_token alone)."""
    config = load("cluster.yaml")
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
              if "bin/ray\" start" in c]
    assert len(starts) == 2
    for command in starts:
        assert "RAY_AUTH_MODE=token" in command, command
        assert 'RAY_AUTH_TOKEN_PATH="${TIERSTACK_HOME:-$HOME/tierstack}/deploy/secrets/token"' in command
    assert "deploy/secrets/token" in config["setup_commands"][0]  # checked before anything starts
