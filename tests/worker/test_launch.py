"""`tierstack launch`: a user's own script with the node's services around it, real daemons."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ds_style_train.py"


def _launch(tmp_path, *args, config=None, env=None, timeout=300):
    cmd = [sys.executable, "-m", "tierstack.cli", "launch"]
    if config is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        cmd += ["--config", str(path)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


DS = {"train_micro_batch_size_per_gpu": 4,
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                            "offload_optimizer": {"device": "cpu"}},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def test_launch_runs_a_deepspeed_style_script_with_a_tier_manager_it_starts_and_removes(tmp_path):
    nvme = tmp_path / "nvme"
    ds = json.loads(json.dumps(DS))
    ds["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(nvme),
                                                "max_in_cpu": 0}
    out = _launch(tmp_path, str(SCRIPT), "--steps", "3", config=ds,
                  env={"TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock",
                       "XDG_STATE_HOME": str(tmp_path / "state")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    job = re.search(r"job (ds_style_train-\d+) at unix:", out.stdout)
    assert job, out.stdout
    assert f"NVMe pool at {nvme}/{job.group(1)}" in out.stderr
    losses = [float(x) for x in re.findall(r"step \d loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert not nvme.exists()  # the job's directory and the parent the run made are gone
    assert not list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))


def test_the_scripts_exit_code_is_the_launchers_and_nothing_is_left(tmp_path):
    out = _launch(tmp_path, "--nvme-path", str(tmp_path / "n"), str(SCRIPT), "--steps", "3",
                  "--fail-at", "1", config=DS,
                  env={"TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock"})
    assert out.returncode == 1
    assert "the script's own error at step 1" in out.stderr
    assert not (tmp_path / "n").exists()


def test_sigterm_to_the_launcher_reaches_the_script_and_the_services_go(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tierstack.cli", "launch", "--nvme-path",
                             str(tmp_path / "n"), "--no-scheduler", str(SCRIPT), "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock"})
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("step 1 "):
                break
            assert time.monotonic() < deadline
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "n").exists()


def test_launch_refuses_a_missing_script_in_one_line(tmp_path):
    out = _launch(tmp_path, str(tmp_path / "nope.py"), timeout=60)
    assert out.returncode == 2 and "is not a file" in out.stderr and "Traceback" not in out.stderr


# ---- the deepspeed launcher's flags ----------------------------------------------------------


def test_num_gpus_1_runs_the_script_as_one_rank(tmp_path):
    out = _launch(tmp_path, "--num_gpus", "1", "--nvme-path", str(tmp_path / "n"), "--no-scheduler",
                  str(SCRIPT), "--steps", "2", config=DS,
                  env={"TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "rank 0 of 1" in out.stdout and len(re.findall(r"step \d loss", out.stdout)) == 2
    assert ", 1 rank, " in out.stderr


def test_num_gpus_2_on_the_cpu_runs_two_gloo_ranks_of_one_partitioned_job(tmp_path):
    """`deepspeed --num_gpus 2 train.py` as tierstack launch runs it on a machine without a
    GPU: two processes with torchrun's variables, whose initialize joins them (gloo) into
    one partitioned job over the one tier manager the launcher started; both train, and
    nothing is left after."""
    port = str(_free_port())
    out = _launch(tmp_path, "--num_gpus", "2", "--master_port", port, "--nvme-path",
                  str(tmp_path / "n"), "--no-scheduler", str(SCRIPT), "--steps", "3",
                  config=dict(DS, train_batch_size=8),  # micro batch 4 x 2 ranks
                  env={"TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock",
                       "XDG_STATE_HOME": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d) of (\d)", out.stdout)) == [("0", "2"), ("1", "2")]
    assert len(re.findall(r"step \d loss", out.stdout)) == 2 * 3
    assert f"2 ranks on the CPU (gloo), meeting at 127.0.0.1:{port}" in out.stderr
    assert not (tmp_path / "n").exists()
    assert not list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flags, says", [
    (["--num_nodes", "2"], "--num_nodes 2: tierstack launch starts ranks on this machine only; "
                           "on several nodes run `torchrun"),
    (["--include", "worker-7:0,1"], "names worker-7: tierstack launch starts ranks on this machine only"),
    (["--include", "localhost:0"], "--include localhost:0: this machine has no GPU; give --num_gpus N"),
    (["--num_gpus", "2", "--exclude", "localhost:1"], "--num_gpus with --include/--exclude: give one"),
    (["--hostfile", "{hostfile}"], "names worker-2 (line 2): tierstack launch starts ranks on this "
                                   "machine only"),
    (["--num_gpus", "0"], "argument --num_gpus/--num-gpus: must be a positive integer, got 0"),
])
def test_what_the_launcher_does_not_do_is_one_line_naming_what_does(tmp_path, flags, says):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2  # this machine\nworker-2 slots=8\n")
    flags = [f.format(hostfile=hostfile) for f in flags]
    out = _launch(tmp_path, *flags, str(SCRIPT), timeout=120,
                  env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU, as on the CI machine
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_config_error_names_the_deepspeed_key_in_one_line(tmp_path):
    """The launcher's own errors name the key the user wrote: the JSON's nvme_path, not the
    tier manager's setting it became; one line, no traceback."""
    (tmp_path / "a-file").write_text("")
    ds = json.loads(json.dumps(DS))
    ds["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "a-file")}
    out = _launch(tmp_path, str(SCRIPT), config=ds, timeout=120,
                  env={"TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/none.sock"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (f"tierstack: zero_optimization.offload_param.nvme_path "
                                  f"{tmp_path / 'a-file'} is a file, not a directory; give a "
                                  f"directory (on an NVMe drive for speed), created if missing")
