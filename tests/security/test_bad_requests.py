"""The requests that broke the daemon (issue 14), each against a live daemon: every one gets
a status that names the mistake, and the daemon goes on serving everyone else."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from tierstack.errors import InvalidArgumentError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import RETRY_PUSHBACK
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment
from tierstack.worker.store.arenas import ArenaMap

HYPER = AdamWHyper(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def put(client: TierManagerClient, key: str, data: torch.Tensor) -> None:
    flat = data.contiguous().view(-1).view(torch.uint8)
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    try:
        lease = client.allocate(flat.numel())
        if flat.numel():
            arenas.sync(lease.arenas_epoch)
            arenas.view(lease.arena, lease.offset, flat.numel()).copy_(flat)
        client.commit(key, lease.lease_id, "uint8", (flat.numel(),), durable=False)
    finally:
        arenas.close()


def block(prefix: str, numel: int, **roles) -> AdamWBlock:
    keys = {role: f"{prefix}/{role}" for role in ("params", "grads", "exp_avg", "exp_avg_sq")}
    keys.update(roles)
    return AdamWBlock(keys["params"], keys["grads"], "", keys["exp_avg"], keys["exp_avg_sq"],
                      "float32", roles.get("grad_dtype", "float32"), 4 * numel,
                      (AdamWSegment(numel, 0, 0, 0),))


def test_a_key_in_two_roles_is_refused_and_wedges_nothing(daemon):
    """params == grads, or a moment == the parameters at step 2, once hung the daemon (its
    own exclusive hold waited for itself); now INVALID_ARGUMENT, and steps on other keys
    and SIGTERM still work."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    for prefix in ("a", "b"):
        put(client, f"{prefix}/params", torch.randn(1000))
        put(client, f"{prefix}/grads", torch.randn(1000))
    for bad, step in ((block("a", 1000, grads="a/params"), 1),
                      (block("a", 1000, exp_avg="a/params"), 2),
                      (block("a", 1000, exp_avg_sq="a/grads"), 1)):
        # Bound by the answer, not the clock: a wedged daemon never answers, and the call
        # ends at its deadline in TierManagerUnavailableError, not this refusal. The
        # deadline is wide: the first step makes the daemon's AdamW (importing torch),
        # 5.5 s once on 2 shared cores.
        with pytest.raises(InvalidArgumentError, match="names tensor .* twice"):
            client.adamw_step([bad], AdamWHyper(**{**HYPER.__dict__, "step": step}), timeout=60)
    # Two blocks of one request sharing a tensor are refused the same way.
    with pytest.raises(InvalidArgumentError, match="twice"):
        client.adamw_step([block("a", 1000), block("b", 1000, grads="a/grads")], HYPER, timeout=10)
    # Others are served. This first valid step makes the daemon's AdamW (importing torch:
    # seconds on a loaded 2-core machine), which the refused ones above no longer wait for.
    result = client.adamw_step([block("b", 1000)], HYPER, timeout=60)
    assert {i.key for i in result.updated} >= {"b/params", "b/exp_avg", "b/exp_avg_sq"}
    client.close()
    assert daemon.stop(timeout=20) == 0  # SIGTERM ends it (a wedged daemon needed SIGKILL)


def test_a_gradient_that_is_not_whole_elements_is_invalid_argument(daemon):
    """13 bytes declared bfloat16 once reached torch and came back INTERNAL: 7 elements
    (14 bytes) do not fit and are INVALID_ARGUMENT; 6 (12 bytes, one byte to spare) do."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    put(client, "c/params", torch.randn(7))
    put(client, "c/grads", torch.zeros(13, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="does not fit grads"):
        client.adamw_step([block("c", 7, grad_dtype="bfloat16")], HYPER, timeout=10)
    with pytest.raises(InvalidArgumentError, match="does not fit grads"):
        client.adamw_step([AdamWBlock("c/params", "c/grads", "", "c/exp_avg", "c/exp_avg_sq",
                                      "float32", "bfloat16", 24, (AdamWSegment(6, 0, 1, 0),))],
                          HYPER, timeout=10)  # an odd offset into bfloat16 elements
    updated = client.adamw_step([AdamWBlock("c/params", "c/grads", "", "c/exp_avg", "c/exp_avg_sq",
                                            "float32", "bfloat16", 28, (AdamWSegment(6, 0, 0, 0),))],
                                HYPER, timeout=60).updated  # the first valid step: torch is imported
    assert "c/params" in {i.key for i in updated}
    client.close()


def test_watch_stats_intervals_out_of_range_are_invalid_argument(daemon):
    """1e13 s once answered UNKNOWN ("timestamp out of range for platform time_t")."""
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.TierManagerStub(channel)
        for interval in (1e13, -1.0, float("nan"), float("inf")):
            with pytest.raises(grpc.RpcError) as err:
                next(stub.WatchStats(pb.WatchStatsRequest(interval_seconds=interval), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, interval
            assert "between 0.05 and 3600" in err.value.details()


def test_streams_never_starve_unary_calls_and_a_disconnect_frees_its_thread(daemon):
    """32 WatchStats streams once took every RPC thread: GetNode and Fetch timed out, and
    stayed stuck after the clients left. Now streams are capped below the thread count (the
    rest answer RESOURCE_EXHAUSTED) and a disconnected one ends at once."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    put(client, "d/x", torch.arange(100))
    channels = [grpc.insecure_channel(daemon.address) for _ in range(40)]
    streams, refused = [], 0
    for channel in channels:  # a long interval: only a disconnect would end these early
        call = pb_grpc.TierManagerStub(channel).WatchStats(pb.WatchStatsRequest(interval_seconds=3600))
        try:
            next(call)
            streams.append(call)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "streams are open" in e.details()
            refused += 1
    assert refused > 0 and len(streams) < 32
    # Unary calls are answered meanwhile; starved, they were not (the streams keep their
    # threads for their hour): the client's 20 s deadline ended them in an error.
    for _ in range(5):
        client.node()
        client.stats()
        (res,) = client.fetch(["d/x"]).tensors
        client.release("d/x", res.info.version)
    for call, channel in zip(streams, channels):  # the watchers go away without cancelling
        channel.close()
    deadline = time.monotonic() + 60  # stuck slots never came back (an hour's interval)
    again = []
    while time.monotonic() < deadline and len(again) < len(streams):
        channel = grpc.insecure_channel(daemon.address)
        call = pb_grpc.TierManagerStub(channel).WatchStats(pb.WatchStatsRequest(interval_seconds=3600))
        try:
            next(call)
            again.append((call, channel))
        except grpc.RpcError:
            channel.close()
            time.sleep(0.1)
    assert len(again) == len(streams)  # every slot came back
    for call, channel in again:
        call.cancel()
        channel.close()
    client.close()


def test_bytes_that_are_no_message_are_invalid_argument_and_health_watch_is_refused(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        for method in ("Commit", "AdamWStep", "Fetch"):
            call = channel.unary_unary(f"/tierstack.tier_manager.v1.TierManager/{method}")
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xff\xff\xff\x0f", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not a valid message" in err.value.details()
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        with pytest.raises(grpc.RpcError) as err:
            next(watch(b"", timeout=10))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Traceback" not in daemon.log_text()


def test_a_quota_beyond_int64_is_invalid_argument_and_changes_nothing(daemon):
    """The fuzzer's find: OpenJob with quota_bytes near 2**64 answered INTERNAL (SQLite
    holds int64) after the job was already half-opened. Now it is refused first."""
    client = TierManagerClient(daemon.address)
    try:
        with pytest.raises(InvalidArgumentError, match=r"quota_bytes 18446744073709551361 is above"):
            client.open_job("huge-quota", quota_bytes=(1 << 64) - 255)
        assert "huge-quota" not in [j.job for j in client.jobs()]
        assert client.open_job("huge-quota", quota_bytes=(1 << 63) - 1).quota_bytes == (1 << 63) - 1
    finally:
        client.close()


def test_a_step_count_beyond_int64_is_invalid_argument(daemon):
    """AdamWStep with step >= 2^63 over real tensors answered INTERNAL (the kernels count
    steps in int64); now INVALID_ARGUMENT naming the range, and nothing changes."""
    from tierstack.services.tier_manager import wire

    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    try:
        put(client, "big/params", torch.randn(1000))
        put(client, "big/grads", torch.randn(1000))
        version = client.describe("big/params").version
        with grpc.insecure_channel(daemon.address) as channel:
            for step in (1 << 63, (1 << 64) - 1):
                request = wire.adamw_request_pb([block("big", 1000)], HYPER, False)
                request.step = step
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.TierManagerStub(channel).AdamWStep(request, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "at most 9223372036854775807" in err.value.details()
        assert client.describe("big/params").version == version
    finally:
        client.close()


# ---- validate first, then wait-or-refuse (issue 53) ---------------------------------------------


def _raw(daemon, method: str, request) -> grpc.RpcError | object:
    """One call, sent once (no client-side retries): its answer, or the error it ended with."""
    with grpc.insecure_channel(daemon.address) as channel:
        try:
            return getattr(pb_grpc.TierManagerStub(channel), method)(request, timeout=60)
        except grpc.RpcError as e:
            return e


def _step(daemon, blocks, hyper=HYPER):
    from tierstack.services.tier_manager import wire

    return _raw(daemon, "AdamWStep", wire.adamw_request_pb(blocks, hyper, False))


def _invalid_steps() -> dict:
    """AdamW requests wrong in themselves, each with its hyperparameters."""
    good = block("q", 1000)
    seg = AdamWSegment
    return {
        "a segment past the end": ([replace(good, segments=(seg(1001, 0, 0, 0),))], HYPER),
        "segments over each other": ([replace(good, segments=(seg(500, 0, 0, 0), seg(500, 1000, 1000, 1000)))], HYPER),
        "segments in another order in the state": (
            [replace(good, segments=(seg(500, 0, 0, 2000), seg(500, 2000, 2000, 0)))], HYPER),
        "an odd offset into the gradients": ([replace(good, segments=(seg(999, 0, 2, 0),))], HYPER),
        "an integer gradient dtype": ([replace(good, grad_dtype="int32")], HYPER),
        "an unknown parameter dtype": ([replace(good, param_dtype="complex7")], HYPER),
        "bf16 parameters without masters": ([replace(good, param_dtype="bfloat16")], HYPER),
        "state bytes that are no whole floats": ([replace(good, state_nbytes=4001)], HYPER),
        "a key in two roles": ([replace(good, exp_avg="q/params")], HYPER),
        "an empty gradients key": ([replace(good, grads="")], HYPER),
        "a NUL in a key": ([replace(good, exp_avg_sq="q/\x00")], HYPER),
        "a param group without rates": ([replace(good, segments=(seg(1000, 0, 0, 0, group=3),))], HYPER),
        "step 0": ([good], replace(HYPER, step=0)),
        "lr NaN": ([good], replace(HYPER, lr=float("nan"))),
        "beta2 of 1": ([good], replace(HYPER, beta2=1.0)),
        "eps infinite": ([good], replace(HYPER, eps=float("inf"))),
        "moments missing at step 2": ([good], replace(HYPER, step=2)),
        "gradients not stored": ([replace(good, grads="q/none")], HYPER),
        "a master not stored": ([replace(good, master="q/none", param_dtype="bfloat16")], HYPER),
    }


def test_an_invalid_step_gets_the_same_answer_whether_or_not_its_tensors_are_held(daemon):
    """The issue's case: a segment past the end of a tensor another client had fetched was
    answered UNAVAILABLE 'Nothing was changed; send the step again', and INVALID_ARGUMENT
    only after the Release: the pin was looked at before the request. Now every request is
    checked first: each of these gets the same answer with the parameters fetched as
    without, on its first call, and never a retry hint."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    try:
        put(client, "q/params", torch.randn(1000))
        put(client, "q/grads", torch.randn(1000))
        version = client.describe("q/params").version
        (held,) = client.fetch(["q/params"]).tensors
        busy = _step(daemon, [block("q", 1000)])  # the pin is what a valid step meets
        assert busy.code() == grpc.StatusCode.UNAVAILABLE and "fetched by 1 reader(s)" in busy.details()
        pinned = {name: _step(daemon, *request) for name, request in _invalid_steps().items()}
        client.release("q/params", held.info.version)
        free = {name: _step(daemon, *request) for name, request in _invalid_steps().items()}
        for name, answer in pinned.items():
            assert isinstance(answer, grpc.RpcError), f"{name}: served"
            assert answer.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
                (name, answer.code(), answer.details())
            assert RETRY_PUSHBACK not in dict(answer.trailing_metadata() or ())
            assert (answer.code(), answer.details()) == (free[name].code(), free[name].details()), name
        assert client.describe("q/params").version == version  # nothing changed, ever
        assert not isinstance(_step(daemon, [block("q", 1000)]), grpc.RpcError)  # the valid one runs
    finally:
        client.close()


def test_a_refused_first_step_does_not_wait_for_the_optimizer_to_be_made(daemon):
    """The daemon makes its AdamW (importing torch: 1-3 s) at its first step. It used to do
    that before looking at the request, so a refused first step took seconds; now only a
    step that passed its checks makes it (seen in the daemon's own memory map)."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    maps = Path(f"/proc/{daemon.proc.pid}/maps")
    try:
        put(client, "r/params", torch.randn(1000))
        put(client, "r/grads", torch.randn(1000))
        for blocks, hyper in _invalid_steps().values():
            assert isinstance(_step(daemon, blocks, hyper), grpc.RpcError)
        assert "libtorch" not in maps.read_text() and "AdamW kernel" not in daemon.log_text()
        client.adamw_step([block("r", 1000)], HYPER, timeout=60)
        assert "libtorch" in maps.read_text()  # made now, and seen where it is
    finally:
        client.close()


def test_a_bad_key_anywhere_in_a_list_changes_nothing(daemon):
    """Delete ['k', ''] used to delete 'k' and then refuse the empty key; Evict and Fetch
    likewise acted on the keys before a bad one. Every key is checked before any is
    touched: a malformed one is INVALID_ARGUMENT, a missing one NOT_FOUND, and 'k' stays."""
    client = TierManagerClient(daemon.address, reconnect_timeout=20)
    try:
        put(client, "k", torch.randn(1000))
        version = client.describe("k").version
        for method, bad in (("Delete", ""), ("Delete", "missing"), ("Evict", "k\x00"),
                            ("Evict", "k" * 1100), ("Fetch", ""), ("Fetch", "missing")):
            answer = _raw(daemon, method, getattr(pb, f"{method}Request")(keys=["k", bad]))
            expected = grpc.StatusCode.NOT_FOUND if bad == "missing" else grpc.StatusCode.INVALID_ARGUMENT
            assert isinstance(answer, grpc.RpcError) and answer.code() == expected, (method, bad, answer)
            info = client.describe("k")
            assert info.version == version and info.in_cpu, (method, bad)
        assert client.stats().pinned == 0
        client.delete(["k", "k"])  # a key named twice is deleted once
        assert client.stats().tensors == 0
    finally:
        client.close()
