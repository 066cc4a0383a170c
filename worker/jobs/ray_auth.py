"""Ray's token authentication, as this process must speak it before `ray.init`.

Ray 2.60 takes a process's mode from its own environment, not from the cluster's:
RAY_AUTH_MODE=token|disabled, and when that is unset, "token" as soon as ~/.ray/auth_token
exists for `ray.init(address="auto")` (any earlier local `ray.init` on the host writes that
file). A driver whose mode differs from its cluster's connects all the same and then
loses every actor ("The actor never ran - it was cancelled before it started running"):
the cluster's workers cannot call back into a driver that demands a token, and a driver
without the token is refused. So before connecting, `join_cluster_auth` asks the
cluster's GCS itself (one gRPC call without a token: refused means it wants one), then
sets this process's mode to match, with the first token the GCS accepts, from Ray's own
places (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) or the cluster's secrets
($TIERSTACK_SECURITY_DIR/token, which deploy/cluster.yaml gives Ray as RAY_AUTH_TOKEN_PATH
on every node). None accepted is a one-line error saying what to set.

`local_ray_auth` is for a Ray this process starts (`tierstack train --ranks N` without
--address): a token of its own for this run, in the environment, so that no
~/.ray/auth_token is written behind the user's back.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from tierstack.addresses import SECURITY_DIR_ENV
from tierstack.errors import InvalidArgumentError, TierstackError

log = logging.getLogger(__name__)

MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
PROBE_SECONDS = 10.0


class RayAuthError(TierstackError):
    """The Ray cluster wants a token this process does not have, or does not answer."""

    grpc_status = "UNAUTHENTICATED"


@dataclass(frozen=True)
class TokenSource:
    """A place a token may come from: its name for messages, the token, its file if any."""

    name: str
    token: str
    path: str = ""


def token_sources() -> list[TokenSource]:
    """Every token this process could send: Ray's places in Ray's order, the cluster's secrets
    second (before Ray's default file, which any local `ray.init` may have written)."""
    found = []
    if os.environ.get(TOKEN_ENV, "").strip():
        found.append(TokenSource(f"${TOKEN_ENV}", os.environ[TOKEN_ENV].strip()))
    files = []
    if os.environ.get(TOKEN_PATH_ENV):
        files.append((f"${TOKEN_PATH_ENV} ({os.environ[TOKEN_PATH_ENV]})", os.environ[TOKEN_PATH_ENV]))
    if os.environ.get(SECURITY_DIR_ENV):
        path = str(Path(os.environ[SECURITY_DIR_ENV]) / "token")
        files.append((f"${SECURITY_DIR_ENV}/token ({path})", path))
    files.append(("~/.ray/auth_token", str(Path.home() / ".ray" / "auth_token")))
    for name, path in files:
        try:
            token = Path(path).read_text().strip()
        except OSError:
            continue
        if token:
            found.append(TokenSource(name, token, str(Path(path).resolve())))
    return found


def gcs_address(address: str) -> str:
    """The cluster's GCS host:port for `--address` (host:port, or "auto": $RAY_ADDRESS, else
    the cluster last started on this host), found as `ray.init` finds it."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address(address)
    except ConnectionError:  # "auto", and no cluster was started on this host
        found = None
    except ValueError as e:
        raise InvalidArgumentError(f"--address {address!r}: {e}; give the head's HOST:6379") from None
    if found is None:
        raise InvalidArgumentError(
            f"--address {address}: no Ray cluster found on this host ($RAY_ADDRESS unset, none "
            f"started here); start one (`.venv/bin/tierstack local-cluster up`, `ray up`) or "
            f"give the head's HOST:6379")
    return found


def gcs_answer(address: str, token: str | None) -> str:
    """"ok", "refused" (token missing or wrong), or why the cluster's GCS did not answer."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_SECONDS,
                              metadata=metadata)
            return "ok"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "refused"
            return f"{e.code().name}: {(e.details() or '')[:120]}"


def join_cluster_auth(address: str) -> str:
    """Set this process's Ray auth mode (and token) to what the cluster at `address` takes,
    before `ray.init`; return the cluster's GCS address. RayAuthError when nothing fits."""
    gcs = gcs_address(address)
    answer = gcs_answer(gcs, None)
    if answer == "ok":  # token auth off there: a driver demanding tokens would lose its actors
        if os.environ.get(MODE_ENV, "").lower() == "token":
            log.warning("the Ray cluster at %s has token authentication off; joining it "
                        "without a token (this process had %s=token)", gcs, MODE_ENV)
        os.environ[MODE_ENV] = "disabled"
        _reload_ray_config()
        return gcs
    if answer != "refused":
        raise RayAuthError(f"the Ray cluster at {gcs} does not answer ({answer}); is it up? "
                           f"(`.venv/bin/ray status --address {gcs}`)")
    tried = []
    for source in token_sources():
        if gcs_answer(gcs, source.token) == "ok":
            os.environ[MODE_ENV] = "token"
            if source.path:  # Ray reads $RAY_AUTH_TOKEN first: only the token that fits stays
                os.environ.pop(TOKEN_ENV, None)
                os.environ[TOKEN_PATH_ENV] = source.path
            _reload_ray_config()
            log.info("Ray cluster %s: token authentication, with the token of %s", gcs, source.name)
            return gcs
        tried.append(source.name)
    raise RayAuthError(
        f"the Ray cluster at {gcs} takes only calls with its token, and "
        f"{'none of ' + ', '.join(tried) + ' is it' if tried else 'this process has none'}; "
        f"set {SECURITY_DIR_ENV} to the cluster's secrets directory (deploy/secrets, where "
        f"`tierstack ray-node --make-secrets` wrote its token) or {TOKEN_PATH_ENV} to its token file")


def local_ray_auth() -> None:
    """Token auth for a Ray this process starts, with a token for this run only, in the
    environment (Ray would write ~/.ray/auth_token, which then changes what a later
    `ray start --head` and `ray.init("auto")` on this host do). An explicit RAY_AUTH_MODE,
    or a token already given, is left as it is."""
    if os.environ.get(MODE_ENV) or os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV):
        return
    os.environ[MODE_ENV] = "token"
    os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    _reload_ray_config()


def _reload_ray_config() -> None:
    """Make this process's Ray read the environment again: its config (the auth mode among
    it) and its token are cached from the first read, which `import ray` may have made."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # as Ray's own _enable_token_auth does after setting RAY_AUTH_MODE
    AuthenticationTokenLoader.instance().reset_cache()
