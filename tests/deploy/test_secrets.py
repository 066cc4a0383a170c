"""`ray up` deploys the cluster's token and TLS certificate: `tierstack ray-node
--make-secrets` writes them, the checkout carries them, and a head's scheduler listening on
the node's address serves only clients that hold them."""

from __future__ import annotations

import stat

import pytest

from tests.security.test_who_may_call import free_port
from tierstack import cli
from tierstack.addresses import SECURITY_DIR_ENV
from tierstack.config import SchedulerConfig
from tierstack.errors import TierstackError
from tierstack.rpc import security_from_dir, write_secrets
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tests.deploy.test_cluster_config import DEPLOY, load


def test_make_secrets_writes_a_private_set_once(tmp_path, capsys):
    directory = tmp_path / "secrets"
    assert cli.main(["ray-node", "--make-secrets", str(directory)]) == 0
    assert str(directory) in capsys.readouterr().out
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
    assert files == {"token": 0o600, "cert.pem": 0o600, "key.pem": 0o600, "ca.pem": 0o600}
    token = (directory / "token").read_bytes()
    assert cli.main(["ray-node", "--make-secrets", str(directory)]) == 0
    assert (directory / "token").read_bytes() == token  # every node must hold the same set


def test_the_cluster_config_hands_the_secrets_to_every_node():
    config = load("cluster.yaml")
    for command in config["head_start_ray_commands"][:1] + config["worker_start_ray_commands"][:1]:
        assert 'TIERSTACK_SECURITY_DIR="${TIERSTACK_HOME:-$HOME/tierstack}/deploy/secrets"' in command
    script = (DEPLOY / "start-node-services.sh").read_text()
    assert 'export TIERSTACK_SECURITY_DIR="$home/deploy/secrets"' in script
    assert ".git" in config["rsync_exclude"] and "deploy/secrets" not in config["rsync_exclude"]


def test_a_scheduler_on_the_network_serves_holders_of_the_secrets_only(tmp_path):
    secrets = tmp_path / "secrets"
    cli.main(["ray-node", "--make-secrets", str(secrets)])
    port = free_port()
    with EmbeddedScheduler(SchedulerConfig(metrics_listen=""), listen=f"0.0.0.0:{port}",
                           env={SECURITY_DIR_ENV: str(secrets)}):
        holder = SchedulerClient(f"127.0.0.1:{port}", timeout=10, security=security_from_dir(secrets))
        assert holder.list_nodes() == []
        holder.close()
        other = write_secrets(tmp_path / "other")
        stranger = SchedulerClient(f"127.0.0.1:{port}", timeout=3, security=security_from_dir(other))
        with pytest.raises(TierstackError):  # another cluster's CA: no handshake, no call
            stranger.list_nodes()
        stranger.close()

