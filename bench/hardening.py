"""Issue 14's closing figures: the fuzzer's requests and statuses, the kill rounds survived,
and each attack of the issue with the test that makes it against a live daemon.

Runs those tests (real daemons, real processes; the other-user ones need root) with
longer budgets than CI's, reads the figures they print, and writes one JSON object to
`--out` (and stdout). A failed attack test is recorded as not refused, never dropped.

    python bench/hardening.py --fuzz-seconds 120 --kill-seconds 120 --out docs/bench/hardening.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (attack from the issue, the test that makes it; "tests/...::name")
ATTACKS = [
    ("AdamWStep naming one key in two roles (wedged the daemon)",
     "tests/security/test_bad_requests.py::test_a_key_in_two_roles_is_refused_and_wedges_nothing"),
    ("WatchStats(interval_seconds=1e13), NaN, inf (UNKNOWN)",
     "tests/security/test_bad_requests.py::test_watch_stats_intervals_out_of_range_are_invalid_argument"),
    ("40 open WatchStats streams starving unary calls; disconnects not freeing threads",
     "tests/security/test_bad_requests.py::test_streams_never_starve_unary_calls_and_a_disconnect_frees_its_thread"),
    ("13-byte gradient declared bfloat16 (INTERNAL)",
     "tests/security/test_bad_requests.py::test_a_gradient_that_is_not_whole_elements_is_invalid_argument"),
    ("bytes that are no message; health Watch holding a thread",
     "tests/security/test_bad_requests.py::test_bytes_that_are_no_message_are_invalid_argument_and_health_watch_is_refused"),
    ("corrupt manifest (garbage header, malformed row, two rows on one extent, deleted)",
     "tests/tier_manager/test_crash_recovery.py::test_a_damaged_manifest_stops_the_start_in_one_line_and_recover_rebuilds_it"),
    ("damaged extent data during --recover",
     "tests/tier_manager/test_crash_recovery.py::test_recover_skips_an_extent_whose_data_was_damaged_and_names_it"),
    ("two daemons on one --nvme-path",
     "tests/tier_manager/test_crash_recovery.py::test_a_second_daemon_on_the_same_pool_is_refused_and_the_first_keeps_its_tensors"),
    ("dead worker's leases and pins held to the lease timeout; finished jobs' state kept forever; no quota",
     "tests/tier_manager/test_sessions_and_jobs.py::test_a_killed_workers_holds_and_its_jobs_state_go_with_it"),
    ("save_checkpoint dying mid-way leaving a mix of steps that loads",
     "tests/worker/test_offload.py::test_a_checkpoint_is_replaced_whole_or_not_at_all_and_verified_on_load"),
    ("another user pre-creating the socket directory 0777",
     "tests/security/test_other_users.py::test_a_socket_directory_another_user_made_or_can_write_is_refused"),
    ("another user planting the pool's data file as a symlink to root's file",
     "tests/security/test_other_users.py::test_a_file_planted_where_the_daemon_writes_is_never_written_through"),
    ("another user reading the manifest/pool/token, calling over loopback TCP (curl, grpc-status 16)",
     "tests/security/test_other_users.py::test_another_user_reads_nothing_and_is_refused_on_loopback_tcp"),
    ("TCP without TLS or token: no token, wrong token, plaintext, a foreign CA; Host header on loopback HTTP",
     "tests/security/test_who_may_call.py::test_loopback_tcp_takes_only_tls_calls_with_the_token_and_http_only_its_host"),
    ("a server beyond loopback without TLS and token (gRPC and HTTP)",
     "tests/security/test_who_may_call.py::test_a_server_beyond_loopback_without_tls_and_token_does_not_start"),
    ("HTTP beyond loopback: no token, wrong token, foreign Host (DNS rebinding), plain HTTP",
     "tests/security/test_who_may_call.py::test_http_beyond_loopback_takes_only_tls_requests_with_the_token_and_its_own_host"),
    ("cluster view fetching file:// and echoing what it read; redirects",
     "tests/security/test_who_may_call.py::test_the_cluster_view_reads_only_http_node_urls_and_echoes_nothing"),
    ("the scheduler's TCP port (ray-node) open to anyone: registering nodes, forgetting jobs",
     "tests/deploy/test_secrets.py::test_a_scheduler_on_the_network_serves_holders_of_the_secrets_only"),
]
FUZZ = "tests/security/test_fuzz_rpc.py"
KILL = ("tests/tier_manager/test_crash_recovery.py::"
        "test_sigkill_during_durable_writes_loses_no_acknowledged_tensor_and_recover_agrees")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz-seconds", type=float, default=120.0, help="fuzzing budget")
    parser.add_argument("--kill-seconds", type=float, default=120.0, help="kill-loop budget")
    parser.add_argument("--out", help="JSON file to write (default: stdout only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        start = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
             f"--junitxml={junit}", FUZZ, KILL, *[test for _, test in ATTACKS]],
            cwd=ROOT, capture_output=True, text=True,
            env={**os.environ, "TIERSTACK_FUZZ_SECONDS": str(args.fuzz_seconds),
                 "TIERSTACK_KILL_SECONDS": str(args.kill_seconds)})
        outcomes = _outcomes(junit)
    figures = {name: json.loads(m.group(1)) for name in ("fuzz", "kill")
               if (m := re.search(rf"{name} figures: (\{{.*\}})$", run.stdout, re.M))}
    result = {
        "command": " ".join(sys.argv),
        "machine": f"{os.cpu_count()} cores, uid {os.getuid()}",
        "seconds": round(time.monotonic() - start, 1),
        "fuzz": {**figures.get("fuzz", {}), "test": outcomes.get(FUZZ, "not run")},
        "kill": {**figures.get("kill", {}), "test": outcomes.get(KILL, "not run")},
        "attacks": [{"attack": attack, "test": test,
                     "refused": outcomes.get(test) == "passed", "outcome": outcomes.get(test, "not run")}
                    for attack, test in ATTACKS],
    }
    if run.returncode != 0:  # what failed, in pytest's words
        result["pytest_tail"] = run.stdout[-3000:].splitlines()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if run.returncode == 0 else 1


def _outcomes(junit: Path) -> dict[str, str]:
    """test id (and, for a file of one test, the file) -> passed / failed / skipped."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        name = case.get("name", "").split("[")[0]  # a parametrized test: all its cases
        for key in (f"{path}::{name}", path):
            out[key] = outcome if out.get(key, outcome) == outcome else "failed"
    return out


if __name__ == "__main__":
    sys.exit(main())
