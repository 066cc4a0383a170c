"""`tierstack launch`: a user's own script with the node's services around it, real daemons."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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
