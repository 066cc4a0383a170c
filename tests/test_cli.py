import json
import subprocess
import sys


def test_demo_moves_bytes_through_both_pools_and_verifies_them(tmp_path, shm_dir):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "64MiB", "arena_size": "32MiB", "shm_dir": str(shm_dir)},
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
