"""Who may call a daemon (issue 14): TLS and the token on TCP, for gRPC and HTTP alike, on
real daemons; a server beyond loopback without them does not start; the cluster view
reads only http(s) node URLs and never echoes what it read."""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from tierstack.addresses import SECURITY_DIR_ENV
from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import security_from_dir, write_secrets
from tierstack.service_process import ServiceProcess, ServiceStartError
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.scheduler.model import Bandwidths, NodeSpec
from tierstack.services.tier_manager.client import TierManagerClient
from tests.metrics.conftest import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tier_manager(tmp_path: Path, shm_dir: Path, listen: str, secrets: Path | None,
                 http_listen: str = "") -> ServiceProcess:
    section = {"cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir)},
               "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "16MiB",
                             "aio": {"block_size": "256KiB", "queue_depth": 2}},
               "manifest_path": str(tmp_path / "manifest.sqlite")}
    if http_listen:
        section["metrics"] = {"http_listen": http_listen}
    return ServiceProcess("tier-manager", "tier_manager", section, listen=listen,
                          workdir=tmp_path / "tm", startup_timeout=30,
                          env={SECURITY_DIR_ENV: str(secrets) if secrets else ""})


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    return write_secrets(tmp_path / "secrets", hosts=("127.0.0.1",))


def test_loopback_tcp_takes_only_tls_calls_with_the_token_and_http_only_its_host(tmp_path, shm_dir, secrets):
    address = f"127.0.0.1:{free_port()}"
    with tier_manager(tmp_path, shm_dir, address, secrets, http_listen="127.0.0.1:0") as daemon:
        client = TierManagerClient(address, reconnect_timeout=10, security=security_from_dir(secrets))
        assert client.node().instance_id  # TLS + the token: served

        ca = (secrets / "ca.pem").read_bytes()
        name = [("grpc.ssl_target_name_override", "tierstack")]
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca), options=name) as channel:
            stub = pb_grpc.TierManagerStub(channel)
            for metadata in ((), (("authorization", "Bearer not-the-token"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Delete(pb.DeleteRequest(keys=["k"]), timeout=5,
                                       metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(address) as channel:  # plaintext: no TLS handshake, no call
            with pytest.raises(grpc.RpcError) as plain:
                pb_grpc.TierManagerStub(channel).GetNode(pb.GetNodeRequest(), timeout=2)
            assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        # A client that trusts another CA never talks to this server (nor sends it a token).
        other = write_secrets(tmp_path / "other", hosts=("127.0.0.1",))
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(
                (other / "ca.pem").read_bytes()), options=name) as channel:
            with pytest.raises(grpc.RpcError) as impostor:
                pb_grpc.TierManagerStub(channel).GetNode(pb.GetNodeRequest(), timeout=2)
            assert impostor.value.code() == grpc.StatusCode.UNAVAILABLE
        # Its HTTP API on loopback: no token needed (the rule), but only its own names as Host.
        url = client.http_endpoint()
        client.close()
        assert _https(url, "/healthz", secrets / "ca.pem")[0] == 200
        status, _, _ = _https(url, "/api/v1/node", secrets / "ca.pem", {"Host": "rebind.example:80"})
        assert status == 400
        log = daemon.log_text()
        assert log.count("refused /tierstack.tier_manager.v1.TierManager/Delete ") == 2
        assert "no token" in log and "a wrong token" in log


def test_a_server_beyond_loopback_without_tls_and_token_does_not_start(tmp_path, shm_dir):
    for listen, http_listen, setting in ((f"0.0.0.0:{free_port()}", "", "security.cert_file"),
                                         (f"unix:{tmp_path}/tm.sock", "0.0.0.0:0",
                                          "tier_manager.metrics.http_listen")):
        with pytest.raises(ServiceStartError) as failed:
            tier_manager(tmp_path, shm_dir, listen, None, http_listen).start()
        assert "beyond loopback" in str(failed.value) and setting in str(failed.value)
        assert "Traceback" not in str(failed.value)


def _https(url: str, path: str, ca: Path, headers: dict | None = None):
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False  # the cluster's certificate names the cluster, not a host
    request = urllib.request.Request(url + path, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context),
                                         _NoRedirects())
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_http_beyond_loopback_takes_only_tls_requests_with_the_token_and_its_own_host(
        tmp_path, shm_dir, secrets):
    with tier_manager(tmp_path, shm_dir, f"unix:{tmp_path}/tm.sock", secrets,
                      http_listen="0.0.0.0:0") as daemon:
        client = TierManagerClient(daemon.address, reconnect_timeout=10)
        url = client.http_endpoint()
        client.close()
        assert url.startswith("https://")
        local = "https://127.0.0.1:" + url.rsplit(":", 1)[1]
        ca, token = secrets / "ca.pem", (secrets / "token").read_text().strip()
        bearer = {"Authorization": f"Bearer {token}"}

        assert _https(local, "/api/v1/node", ca)[0] == 401
        assert _https(local, "/metrics", ca, {"Authorization": "Bearer wrong"})[0] == 401
        status, body, _ = _https(local, "/api/v1/node", ca, bearer)
        assert status == 200 and json.loads(body)["node"]
        assert _https(local, "/healthz", ca)[0] == 200  # liveness needs no token
        # DNS rebinding: a page elsewhere resolving its own name to this address.
        status, body, _ = _https(local, "/api/v1/node", ca, {**bearer, "Host": "evil.example"})
        assert status == 400 and "evil.example" in body
        # A browser opens the dashboard once with ?token=, then holds it in a cookie.
        status, _, headers = _https(local, f"/dashboard/?token={token}", ca)
        assert status == 303 and headers["Location"] == "/dashboard/"
        assert "HttpOnly" in headers["Set-Cookie"] and "Secure" in headers["Set-Cookie"]
        with pytest.raises(OSError):  # no plain HTTP on the TLS port
            urllib.request.urlopen(local.replace("https", "http") + "/healthz", timeout=5)
        log = daemon.log_text()
        assert log.count("HTTP API refused") == 3, log
        assert "evil.example" in log


class _Planted(http.server.BaseHTTPRequestHandler):
    """A 'node' whose HTTP API answers with a secret, or redirects to a file."""

    secret = "SECRET-0600-VALUE"

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "file:///etc/shadow")
            self.end_headers()
            return
        body = json.dumps({"node": self.secret, "tiers": self.secret}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_cluster_view_reads_only_http_node_urls_and_echoes_nothing(tmp_path):
    planted = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Planted)
    threading.Thread(target=planted.serve_forever, daemon=True).start()
    node_url = f"http://127.0.0.1:{planted.server_address[1]}"
    spec = dict(gpu_bytes=0, cpu_bytes=1 << 30, nvme_bytes=1 << 30, bandwidth=Bandwidths(1e9, 1e9, 1e9, 1e9))
    try:
        with EmbeddedScheduler(SchedulerConfig(metrics_listen="127.0.0.1:0")) as scheduler:
            client = SchedulerClient(scheduler.address, timeout=10)
            for url in ("file:///etc/shadow", "ftp://127.0.0.1/x", "gopher://127.0.0.1:70/x"):
                with pytest.raises(InvalidArgumentError, match="not an http"):
                    client.register_node(NodeSpec("n0", **spec), metrics_url=url)
            client.register_node(NodeSpec("secret-node", **spec), metrics_url=node_url)
            client.register_node(NodeSpec("redirect-node", **spec),
                                 metrics_url=node_url + "/redirect")
            client.close()
            url = wait_for(lambda: (line := [w for w in scheduler.log_text().split()
                                            if w.startswith("http://127.0.0.1:")]) and line[0],
                           what="the scheduler's URL")
            url = url.split("/dashboard/")[0]
            with urllib.request.urlopen(url + "/api/v1/cluster", timeout=10) as response:
                body = response.read().decode()
            view = json.loads(body)
            assert len(view["unreachable"]) == 2 and not view["nodes"]
            assert _Planted.secret not in body and "shadow" not in body
            assert "HTTP 302" in body and "not a tierstack node snapshot" in body
    finally:
        planted.shutdown()


def test_a_node_whose_certificate_this_process_does_not_trust_is_listed_with_how_to_trust_it(
        tmp_path, secrets, monkeypatch):
    """A browser or a client without the cluster's CA refuses its self-signed certificate:
    the cluster view's error says which CA file to trust and how to check it."""
    from tierstack.dashboards.cluster_view import NodeAnswerError, RemoteNode
    served = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Planted)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(secrets / "cert.pem", secrets / "key.pem")
    served.socket = context.wrap_socket(served.socket, server_side=True)
    threading.Thread(target=served.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{served.server_address[1]}"
    monkeypatch.delenv(SECURITY_DIR_ENV, raising=False)
    try:
        with pytest.raises(NodeAnswerError) as refused:
            RemoteNode(url).snapshot()
        message = str(refused.value)
        assert "not signed by a CA this process trusts" in message
        assert SECURITY_DIR_ENV in message and "curl --cacert ca.pem" in message
        # With the cluster's secrets directory named, the same node is read.
        monkeypatch.setenv(SECURITY_DIR_ENV, str(secrets))
        with pytest.raises(NodeAnswerError, match="not a tierstack node snapshot"):
            RemoteNode(url).snapshot()
    finally:
        served.shutdown()
