import json
import subprocess
import sys


def test_demo_moves_bytes_through_both_pools_and_verifies_them(tmp_path, shm_dir):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "64MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "64MiB"}}}))
    out = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "demo", "--config", str(config),
         "--total", "32MiB", "--tensor-size", "4MiB"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "every byte verified" in out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("nvme", "cpu")}
    assert set(rows) == {"nvme", "cpu"}
    assert all(float(rows[t][-1]) > 0 and float(rows[t][-2]) > 0 for t in rows)


def test_bad_config_key_exits_with_its_name(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"tier_manager": {"cpu_pol": {}}}))
    out = subprocess.run([sys.executable, "-m", "tierstack.cli", "demo", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown config key tier_manager.cpu_pol" in out.stderr


def test_train_runs_with_state_spilling_to_nvme_and_the_loss_falls(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "train", "--steps", "6", "--layers", "3",
         "--dim", "64", "--heads", "4", "--seq-len", "64", "--cpu-pool-size", "1MiB",
         "--nvme-path", str(tmp_path / "nvme")],
        capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = out.stdout.replace("\n", " ")
    assert "done: 6 steps" in summary
    # The embedded daemon serves the dashboard and says where; progress shows every link.
    assert "dashboard: http://127.0.0.1:" in summary
    assert all(f"{link} " in summary for link in ("nvme->cpu", "cpu->nvme", "cpu->dev", "dev->cpu"))
    read_gb = float(summary.split("done: ")[1].split("NVMe read ")[1].split(" GB")[0])
    assert read_gb > 0  # the state did not fit the CPU pool
    first, last = summary.split("done: ")[1].split("loss ")[1].split(",")[0].split(" -> ")
    assert float(last) < float(first)


def _train_cli(tmp_path, config: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "train", "--config", str(path), *args],
        capture_output=True, text=True, timeout=timeout,
        env={**__import__("os").environ, "COLUMNS": "200"})


def test_train_takes_batch_accumulation_and_device_budget_from_the_config(tmp_path):
    """Without --batch-size / --device-budget the config's train section decides: a batch
    of micro_batch_size x gradient_accumulation_steps rows, and the device budget."""
    config = {"train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2,
                        "device_budget": "5MiB", "params": {"device": "nvme"},
                        "optimizer_state": {"device": "nvme"}}}
    out = _train_cli(tmp_path, config, "--steps", "2", "--layers", "2", "--dim", "64", "--heads", "4",
                     "--seq-len", "32", "--cpu-pool-size", "4MiB", "--no-scheduler",
                     "--nvme-path", str(tmp_path / "nvme"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = out.stdout.replace("\n", " ")
    assert "batch 4 in 2 micro-batches" in summary
    assert "device budget 5 MiB" in summary
    assert "done: 2 steps" in summary
    assert "device budget peak" in summary and "of 5 MiB" in summary.split("done: ")[1]


def test_train_refuses_a_batch_that_does_not_split_into_micro_batches(tmp_path):
    out = _train_cli(tmp_path, {"train": {"gradient_accumulation_steps": 3}}, "--batch-size", "4",
                     timeout=120)
    assert out.returncode == 2
    assert "--batch-size 4 does not split into train.gradient_accumulation_steps = 3" in out.stderr


def test_partitioned_train_refuses_accumulation_before_starting_anything(tmp_path):
    out = _train_cli(tmp_path, {"train": {"gradient_accumulation_steps": 2}}, "--ranks", "2",
                     timeout=120)
    assert out.returncode == 2
    assert "partitioned training (--ranks, --address) does not accumulate" in out.stderr
