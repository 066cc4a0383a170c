"""UNAVAILABLE only for what passes (issue 53): every place the daemon answers "send it
again" is listed here with the event that ends it, and a test shows that event ending it.

The list is checked against the code: every `raise` of a retryable error (RetryLaterError,
or any project error whose status is UNAVAILABLE) in services/tier_manager/ is found by
reading the source, so a new one fails `test_every_retryable_refusal_is_listed` until it
is listed here with its event and a test of it. What no retry can serve (a full tmpfs,
pins nothing will release, an invalid request) is RESOURCE_EXHAUSTED or
INVALID_ARGUMENT instead, at once: test_pool_over_small_tmpfs.py and
tests/security/test_bad_requests.py.

The states are reached through the daemon's own parts and code paths; where one has to
be held while the refused call is made (a read from NVMe, an eviction's write, a job's
deletion), the thread doing it is stopped as it enters a named function (`stopped_in`)
and let go as the event.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tierstack.config import JobsConfig
from tierstack.errors import KeyNotFoundError, RetryLaterError, TierstackError

ROOT = Path(__file__).resolve().parents[2]
DAEMON_CODE = ROOT / "services" / "tier_manager"

# (file, function, a fragment of its message) -> (the event that ends it, the test showing it)
INVENTORY = {
    ("admission.py", "enter", "the tier manager is busy"):
        ("a slot freeing: another long call returns",
         "test_busy_slots_end_when_a_slot_frees_and_an_invalid_call_is_never_busy"),
    ("leases.py", "fetch", "is being updated in place"):
        ("the optimizer step's update of that tensor ends",
         "test_a_fetch_refused_for_an_update_is_served_once_the_update_ends"),
    ("leases.py", "fetch", "still being read from NVMe by another fetch"):
        ("the other fetch's read from NVMe finishes",
         "test_a_fetch_refused_for_another_fetch_s_read_is_served_once_the_read_ends"),
    ("leases.py", "get", "stayed"):
        ("the update or load ends (in-process tools only, never an RPC)",
         "test_get_refused_for_an_update_is_served_once_the_update_ends"),
    ("updates.py", "_hold", "an optimizer step changes it in place"):
        ("the readers' Release, or the other step's end",
         "test_a_step_refused_for_a_pin_or_another_step_runs_once_that_ends"),
    ("updates.py", "_hold", "was evicted or fetched while an optimizer step waited"):
        ("the Release of the reader that pinned it during its eviction",
         "test_a_step_refused_for_a_reader_met_during_an_eviction_runs_once_it_releases"),
    ("spill.py", "allocate", "bytes are on their way out of the pool"):
        ("the update in place (or send-out) holding that room ends",
         "test_an_allocation_refused_for_room_on_its_way_is_served_once_it_comes"),
    ("spill.py", "evict", "evict it again once that ends"):
        ("the load, update or eviction under way ends",
         "test_an_eviction_refused_for_an_update_runs_once_the_update_ends"),
    ("jobs.py", "open", "is being deleted"):
        ("the deletion of the job's state finishes",
         "test_opening_a_job_being_deleted_is_served_once_the_deletion_finishes"),
    ("jobs.py", "_delete", "now; ask again"):
        ("the deletion under way finishes",
         "test_opening_a_job_being_deleted_is_served_once_the_deletion_finishes"),
}


# ---- the list against the code -------------------------------------------------------------


def _unavailable_errors() -> set[str]:
    """Names of the project's errors answered UNAVAILABLE (the daemon's modules loaded,
    so every subclass is known)."""
    import tierstack.services.tier_manager.daemon  # noqa: F401 - registers its error classes
    import tierstack.service_process  # noqa: F401

    names, todo = set(), [TierstackError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.grpc_status == "UNAVAILABLE":
            names.add(cls.__name__)
    return names


def _message_text(node: ast.AST) -> str:
    """The literal text of an error's message (an f-string's constant parts)."""
    return "".join(part.value for part in ast.walk(node)
                   if isinstance(part, ast.Constant) and isinstance(part.value, str))


def retryable_sites() -> list[tuple[str, str, str]]:
    """(file, enclosing function, message text) of every raise of an UNAVAILABLE error in
    the daemon's code, and of every other mention of the status itself."""
    errors = _unavailable_errors()
    sites = []
    for path in sorted(DAEMON_CODE.glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            for node in ast.walk(function):
                call = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) in errors:
                    message = _message_text(call.args[0]) if call.args else ""
                    sites.append((path.name, function.name, message))
                if isinstance(node, ast.Attribute) and node.attr == "UNAVAILABLE":
                    sites.append((path.name, function.name, "grpc.StatusCode.UNAVAILABLE"))
    # A function nested in another is walked twice: once is enough.
    return sorted(set(sites))


def test_every_retryable_refusal_is_listed_with_the_event_that_ends_it():
    sites = retryable_sites()
    assert sites, "the scan found nothing: it no longer reads the daemon's code"
    unlisted = [s for s in sites if not any(s[0] == f and s[1] == fn and frag in s[2]
                                            for f, fn, frag in INVENTORY)]
    assert not unlisted, (
        f"the daemon answers UNAVAILABLE (send it again) at {unlisted}: list each in INVENTORY "
        f"with the event that ends it and a test that shows it (or, where no retry can serve "
        f"the call, raise a non-retryable error: RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ...)")
    gone = [entry for entry in INVENTORY if not any(
        s[0] == entry[0] and s[1] == entry[1] and entry[2] in s[2] for s in sites)]
    assert not gone, f"listed but no longer in the code: {gone}; remove them from INVENTORY"
    missing = [test for _, test in INVENTORY.values() if not callable(globals().get(test))]
    assert not missing, f"INVENTORY names tests that do not exist: {missing}"


# ---- holding a state while a refused call is made ---------------------------------------------------


@contextlib.contextmanager
def stopped_in(function, target, *args):
    """Run `target(*args)` on a thread that stops as it enters `function` (the daemon's
    own code, unchanged) and goes on when the block ends; yields what it returned or
    raised, filled in after the block."""
    reached, go = threading.Event(), threading.Event()
    code = function.__code__
    out: dict = {}

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is code and not reached.is_set():
            reached.set()
            go.wait(120)

    def run():
        sys.settrace(tracer)
        try:
            out["value"] = target(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert reached.wait(60), f"{function.__qualname__} was never entered"
    try:
        yield out
    finally:
        go.set()
        thread.join(120)
        assert not thread.is_alive()


def refused(call) -> RetryLaterError:
    """The RetryLaterError `call()` raises (with a retry hint), failing if it is served."""
    with pytest.raises(RetryLaterError) as err:
        call()
    assert err.value.retry_after > 0
    return err.value


@pytest.fixture
def reg(tier_config):
    from tierstack.services.tier_manager.registry import TierRegistry

    with TierRegistry(tier_config) as registry:  # an 8 MiB CPU pool, 64 MiB of NVMe
        yield registry


def _mib(value: float = 0.0) -> torch.Tensor:
    return torch.full((256 * 1024,), value)  # 1 MiB of float32


# ---- each refusal and the event that ends it --------------------------------------------------------


def test_a_fetch_refused_for_an_update_is_served_once_the_update_ends(reg):
    reg.put("u", _mib(), tier="cpu")
    claim = reg.updates.claim(["u"])
    info, _ = reg.updates.begin(claim, "u")
    assert "fetch it again when the step ends" in str(refused(lambda: reg.leases.fetch("u")))
    new = reg.updates.end(claim, info, changed=True)  # the event
    fetched, _ = reg.leases.fetch("u")
    assert fetched.version == new.version
    reg.leases.release("u", fetched.version)


def test_a_fetch_refused_for_another_fetch_s_read_is_served_once_the_read_ends(reg):
    from tierstack.services.tier_manager.spill import Spill

    reg.put("n", _mib(3.0), tier="nvme")  # only on NVMe: a fetch reads it in
    with stopped_in(Spill.read_in, reg.leases.fetch, "n") as first:  # LOADING, held there
        assert "still being read from NVMe" in str(refused(lambda: reg.leases.fetch("n")))
    info, buffer = first["value"]  # the event: the first fetch's read finished
    again, same = reg.leases.fetch("n")
    assert same == buffer and again.version == info.version
    for _ in range(2):
        reg.leases.release("n", info.version)


def test_get_refused_for_an_update_is_served_once_the_update_ends(reg, monkeypatch):
    from tierstack.services.tier_manager import leases

    monkeypatch.setattr(leases, "GET_WAIT_SECONDS", 0.2)  # its wait, not 60 s, in this test
    reg.put("g", _mib(), tier="cpu")
    claim = reg.updates.claim(["g"])
    info, buffer = reg.updates.begin(claim, "g")
    refused(lambda: reg.leases.get("g"))
    torch.frombuffer(reg.view(buffer), dtype=torch.float32).fill_(2.0)
    reg.updates.end(claim, info, changed=True)  # the event
    assert reg.leases.get("g").eq(2.0).all()


def test_a_step_refused_for_a_pin_or_another_step_runs_once_that_ends(reg):
    reg.put("p", _mib(), tier="cpu")
    info, _ = reg.leases.fetch("p")  # a client's pin
    error = refused(lambda: reg.updates.claim(["p"]))
    assert "fetched by 1 reader(s)" in str(error) and "Nothing was changed" in str(error)
    reg.leases.release("p", info.version)  # the event: the reader's Release
    first = reg.updates.claim(["p"])
    assert "claimed by another call" in str(refused(lambda: reg.updates.claim(["p"])))
    reg.updates.abandon(first)  # the event: the other step ends
    reg.updates.abandon(reg.updates.claim(["p"]))


def test_a_step_refused_for_a_reader_met_during_an_eviction_runs_once_it_releases(reg):
    from tierstack.services.tier_manager.spill import Spill

    reg.put("e", _mib(), tier="cpu")  # no NVMe copy: its eviction writes one first
    out: list = []
    stepper = threading.Thread(target=lambda: out.append(_claim_or_error(reg, "e")))
    with stopped_in(Spill._write_out, reg.spill.evict, "e"):  # LEAVING, held there
        stepper.start()  # the step pins it and waits for the eviction (the daemon's own IO)
        _until(reg, lambda: reg.records.get("e").pins == 1, "the step never waited for the eviction")
        reader, _ = reg.leases.fetch("e")  # a reader pins it meanwhile: it keeps its copy
    stepper.join(60)
    (error,) = out
    assert isinstance(error, RetryLaterError) and "was evicted or fetched while" in str(error)
    reg.leases.release("e", reader.version)  # the event: the reader's Release
    reg.updates.abandon(reg.updates.claim(["e"]))


def _until(reg, condition, why: str) -> None:
    """Wait for `condition()`, read under the records' lock (where the parts move it)."""
    deadline = time.monotonic() + 60
    while True:
        with reg.records.lock:
            if condition():
                return
        assert time.monotonic() < deadline, why
        time.sleep(0.01)


def _claim_or_error(reg, key):
    try:
        return reg.updates.claim([key])
    except RetryLaterError as e:
        return e


def test_an_allocation_refused_for_room_on_its_way_is_served_once_it_comes(reg):
    reg.put("held", _mib(), tier="cpu")  # being updated below: room on its way
    pins = []
    for i in range(7):  # the rest of the 8 MiB pool, fetched by "clients": never evictable
        reg.put(f"pinned{i}", _mib(), tier="cpu")
        pins.append(reg.leases.fetch(f"pinned{i}")[0])
    claim = reg.updates.claim(["held"])
    info, _ = reg.updates.begin(claim, "held")
    error = refused(lambda: reg.allocate_buffer(1 << 20))
    assert "bytes are on their way out of the pool" in str(error)
    reg.updates.end(claim, info, changed=False)  # the event: the update ends
    reg.free_buffer(reg.allocate_buffer(1 << 20))  # "held" was evicted for it
    assert not reg.info("held").in_cpu
    for i, pin in enumerate(pins):
        reg.leases.release(f"pinned{i}", pin.version)


def test_an_eviction_refused_for_an_update_runs_once_the_update_ends(reg):
    reg.put("v", _mib(), tier="cpu")
    claim = reg.updates.claim(["v"])
    info, _ = reg.updates.begin(claim, "v")
    refused(lambda: reg.spill.evict("v"))
    reg.updates.end(claim, info, changed=False)  # the event
    assert not reg.spill.evict("v").in_cpu


def test_opening_a_job_being_deleted_is_served_once_the_deletion_finishes(reg):
    from tierstack.services.tier_manager.jobs import JobTable

    jobs = JobTable(reg, reg.durable.manifest, JobsConfig())
    jobs.open("j", "a-session", keep=False, quota=0)
    reg.put("j/x", _mib(), tier="cpu")
    with stopped_in(JobTable._delete_versions, jobs.delete, "j", True) as deletion:
        error = refused(lambda: jobs.open("j", "another-session", keep=False, quota=0))
        assert "is being deleted" in str(error)
        assert "now; ask again" in str(refused(lambda: jobs.delete("j", True)))
    assert deletion["value"] == 1  # the event: the deletion finished
    opened = jobs.open("j", "another-session", keep=False, quota=0)  # a new job
    assert opened.tensors == 0
    with pytest.raises(KeyNotFoundError):
        reg.info("j/x")


def test_busy_slots_end_when_a_slot_frees_and_an_invalid_call_is_never_busy(reg):
    """Every slot a client may take is in use: its next long call is refused with a retry
    hint and a slot freeing ends that; an invalid call is INVALID_ARGUMENT all along (its
    check comes first), and a call without a session is told how to get slots of its own."""
    import grpc

    from tierstack.proto import tier_manager_pb2 as pb
    from tierstack.rpc import RETRY_PUSHBACK
    from tierstack.services.tier_manager.server import TierManagerServicer

    servicer = TierManagerServicer(reg)
    reg.put("k", _mib(), tier="cpu")
    try:
        with contextlib.ExitStack() as held:
            for _ in range(servicer.slots.per_client):  # the calls of sessionless clients
                held.enter_context(servicer.slots.enter("", "Fetch"))
            busy = _call(servicer.Fetch, pb.FetchRequest(keys=["k"]))
            assert busy.code == grpc.StatusCode.UNAVAILABLE and RETRY_PUSHBACK in busy.trailers
            assert "open a client session" in busy.details, busy.details
            for request, method in ((pb.FetchRequest(keys=["k", ""]), servicer.Fetch),
                                    (pb.EvictRequest(keys=["k", "\x00"]), servicer.Evict),
                                    (pb.DeleteRequest(keys=["k", "x" * 2000]), servicer.Delete),
                                    (pb.AllocateBufferRequest(nbytes=1 << 40), servicer.AllocateBuffer),
                                    (pb.AdamWStepRequest(step=0), servicer.AdamWStep)):
                answer = _call(method, request)
                assert answer.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                       grpc.StatusCode.RESOURCE_EXHAUSTED), (request, answer)
            missing = _call(servicer.Fetch, pb.FetchRequest(keys=["k", "none"]))
            assert missing.code == grpc.StatusCode.NOT_FOUND
            held.close()  # the event: the slots free
            fetched = _call(servicer.Fetch, pb.FetchRequest(keys=["k"]))
            assert fetched.code is None and len(fetched.value.tensors) == 1
        assert reg.info("k").in_cpu  # nothing an invalid call named was evicted or deleted
    finally:
        servicer.stop()


class _Aborted(Exception):
    pass


class _Answer:
    """How a servicer method ended: its value, or the status it aborted with."""

    def __init__(self) -> None:
        self.code = self.details = self.value = None
        self.trailers: dict = {}

    # The parts of grpc.ServicerContext the servicer uses.
    def invocation_metadata(self):
        return ()

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, metadata) -> None:
        self.trailers = dict(metadata)

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted()


def _call(method, request) -> _Answer:
    answer = _Answer()
    try:
        answer.value = method(request, answer)
    except _Aborted:
        pass
    return answer
