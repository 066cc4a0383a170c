import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tierstack import cli


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
         "--dim", "64", "--heads", "4", "--seq-len", "64", "--nvme-path", str(tmp_path / "nvme")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = out.stdout.replace("\n", " ")
    assert "done: 6 steps" in summary
    # The embedded daemon serves the dashboard and says where; progress shows every link.
    assert "dashboard: http://127.0.0.1:" in summary
    assert all(f"{link} " in summary for link in ("nvme->cpu", "cpu->nvme", "cpu->dev", "dev->cpu"))
    # No pool sized by hand (the caps are the machine's budgets), yet the main job's state
    # leaves the CPU pool between uses (its config: offload to NVMe, max_in_cpu 0).
    assert "CPU pool up to the machine's budget" in summary
    assert _nvme_volumes(summary) > (0, 0)
    first, last = summary.split("done: ")[1].split("loss ")[1].split(",")[0].split(" -> ")
    assert float(last) < float(first)


def _our_daemons(parent: int) -> list[int]:
    """Pids of daemons started by `parent` (they are told to exit with it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"--exit-with-parent" in cmdline and cmdline[cmdline.index(b"--exit-with-parent") + 1] \
                == str(parent).encode():
            pids.append(int(proc.name))
    return pids


def _train_then_stop(flags: list[str], stop, code: int) -> str:
    """`tierstack train --steps 100000 flags` in a session of its own; once two steps are
    done, `stop(proc)`; it must then exit with `code`. Its output."""
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "tierstack.cli", "train", "--steps", "100000", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "COLUMNS": "200"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while sum(line.startswith("step ") for line in list(lines)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-2000:]
            time.sleep(0.2)
        stop(proc)
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == code, err[-2000:]
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return "".join(lines)


def test_sigterm_to_a_job_s_group_ends_it_after_its_step_with_a_checkpoint_to_resume(tmp_path):
    """A batch scheduler's SIGTERM to the job's process group (and again to the job, as a
    wrapper such as make passes it on): the job finishes the step in progress, saves its checkpoint at that step, stops its daemons (they are in their own
    group, so the signal did not stop them mid-step), removes its NVMe run directory and
    exits 143; the checkpoint resumes. (Raising from the handler instead once hung a job
    for good, the signal landing while a lock was held.)"""

    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    flags = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
             "--no-scheduler", "--log-every", "0", "--nvme-path", str(nvme), "--checkpoint-dir", str(ckpt)]
    daemons: list[int] = []

    def stop(proc: subprocess.Popen) -> None:
        daemons.extend(_our_daemons(proc.pid))
        assert daemons and any(nvme.iterdir())  # its daemon, and its run directory
        os.killpg(proc.pid, signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)  # passed on again, as make does to its children

    out = _train_then_stop(flags, stop, 143)
    stopped = re.search(r"stopped by SIGTERM after step (\d+) of 100000", out)
    assert stopped, out[-2000:]
    step = int(stopped.group(1))
    tag = ckpt / f"global_step{step}"
    assert f"checkpoint: {tag} (step {step})" in out and f"done: {step} steps" in out, out[-2000:]
    assert not nvme.exists()  # the run made it, and removed it with its run directory
    assert not any(Path(f"/proc/{pid}").exists() for pid in daemons)
    resumed = subprocess.run([sys.executable, "-m", "tierstack.cli", "train", "--steps", str(step + 1),
                              "--resume", *flags], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from {tag} after step {step}" in resumed.stdout  # the tag `latest` named
    assert "done: 1 steps" in resumed.stdout
    # The resumed run's checkpoint replaced the one it resumed from (--keep-checkpoints 1).
    assert sorted(os.listdir(ckpt)) == [f"global_step{step + 1}", "latest"]


def _nvme_volumes(stdout: str) -> tuple[float, float]:
    """Bytes read and written on NVMe, as the run's last line says them."""
    units = {"MB": 1e6, "GB": 1e9}
    found = re.search(r"NVMe read ([\d.]+) (MB|GB), written ([\d.]+) (MB|GB)", stdout)
    assert found, stdout[-1000:]
    read, read_unit, written, written_unit = found.groups()
    return float(read) * units[read_unit], float(written) * units[written_unit]


def _train_cli(tmp_path, config: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "train", "--config", str(path), *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "COLUMNS": "200"})


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


# ---- the user's surface: one-line errors, help, plan, doctor, Hugging Face models ----------



def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """`tierstack argv...` in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(capsys, *argv: str) -> str:
    code, out, err = _main(capsys, *argv)
    assert code not in (0, None), (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    return lines[0]


TINY = ("--steps", "1", "--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16")


@pytest.mark.parametrize("argv, says", [
    (("--cpu-pool-size", "0"), "--cpu-pool-size: must be more than 0 bytes"),
    (("--cpu-pool-size", "most"), "(64MiB, 16GiB, 1.5TB); or 'auto' for the machine's budget"),
    (("--cpu-pool-size", "lots"), "cannot read 'lots' as a size"),
    (("--steps", "-3"), "--steps: must be a positive integer, got -3"),
    (("--batch-size", "0"), "--batch-size: must be a positive integer, got 0"),
    (("--layers", "0"), "--layers: must be a positive integer, got 0"),
    (("--dim", "64", "--heads", "5"), "--dim 64 does not split into --heads 5 equal attention heads; use --heads 4"),
    (("--nvme-path", "/proc/tierstack-x"), "--nvme-path /proc/tierstack-x: cannot create and write a directory there"),
    (("--device", "tpu"), "--device 'tpu' is not a device; use cpu, cuda or cuda:N"),
    (("--resume",), "--resume needs --checkpoint-dir"),
    (("--hf-model", "/nonexistent/llama"), "--hf-model /nonexistent/llama: no such file or directory"),
    (("--hf-model", "x", "--dim", "64"), "--dim size the built-in GPT; with --hf-model the Hugging Face config sets"),
    (("--data", "/nonexistent.txt"), "--data /nonexistent.txt: no such file"),
    (("--ranks", "2", "--export", "out"), "partitioned training (--ranks, --address) does not take --export yet"),
])
def test_train_refuses_bad_input_in_one_line(capsys, argv, says):
    line = _one_line_error(capsys, "train", "--steps", "1", "--seq-len", "16", *argv)
    assert says in line, line


def test_train_refuses_a_file_as_nvme_path(capsys, tmp_path):
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    line = _one_line_error(capsys, "train", *TINY, "--nvme-path", str(file))
    assert f"--nvme-path {file} is a file, not a directory" in line


def test_train_resume_without_a_checkpoint_names_what_to_give(capsys, tmp_path):
    """--resume reads the tag `latest` names, as the engine does; without one it says what
    is there, before anything starts."""
    line = _one_line_error(capsys, "train", *TINY, "--checkpoint-dir", str(tmp_path), "--resume")
    assert f"--resume: {tmp_path} has no 'latest' file and holds no checkpoint itself; save a " \
           f"checkpoint there first" in line
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "global_step3" / "engine.pt").write_bytes(b"")
    line = _one_line_error(capsys, "train", *TINY, "--checkpoint-dir", str(tmp_path), "--resume")
    assert f"--resume: {tmp_path} has no 'latest' file; write the tag to resume from into it " \
           f"(tags there: global_step3)" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_train_on_cuda_without_cuda_is_one_line(capsys):
    line = _one_line_error(capsys, "train", *TINY, "--device", "cuda")
    assert "--device cuda: torch sees no CUDA device on this machine" in line and "--device cpu" in line


STORE_WAIT = 60.0
"""Seconds a store waits for a tier manager that restarts (LayerStore's reconnect_timeout):
what a wrong address used to cost before it was checked within 2 s."""


def test_a_tier_manager_that_is_not_there_fails_within_two_seconds(capsys, tmp_path, monkeypatch):
    from tierstack.rpc import RpcClient

    def no_client(*args, **kwargs):
        raise AssertionError("a gRPC client was made: its first call would wait for a daemon")

    with monkeypatch.context() as patched:  # a missing socket is told without any call
        patched.setattr(RpcClient, "__init__", no_client)
        line = _one_line_error(capsys, "train", *TINY, "--tier-manager", "unix:/missing.sock")
    assert "nothing listens there (/missing.sock does not exist)" in line
    # A socket file with nobody accepting on it (what a killed daemon leaves): told at once
    # too, by one refused connect, no gRPC call waiting out its deadline.
    path = tmp_path / "dead.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))  # bound, never listening: connections are refused
    try:
        with monkeypatch.context() as patched:
            patched.setattr(RpcClient, "__init__", no_client)
            line = _one_line_error(capsys, "train", *TINY, "--tier-manager", f"unix:{path}")
        assert f"nothing listens on {path}" in line
    finally:
        dead.close()


def test_a_printed_line_and_another_threads_log_line_never_share_a_line_of_a_pipe():
    """`tierstack train 2>&1 | cat` under PYTHONUNBUFFERED glued a plan line the job printed
    to the plan watcher's log line (print's text and newline were two writes). The CLI's
    whole_lines() sends each line in one write: none of thousands is glued."""
    script = ("import logging, sys, threading\n"
              "from tierstack.cli import whole_lines\n"
              "whole_lines()\n"
              "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
              "log = logging.getLogger('watcher')\n"
              "thread = threading.Thread(target=lambda: [log.info('plan v%d', i) for i in range(5000)])\n"
              "thread.start()\n"
              "for i in range(5000):\n"
              "    print(f'scheduler plan v{i}', flush=True)\n"
              "thread.join()\n")
    out = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}).stdout
    lines = out.splitlines()
    glued = [l for l in lines if not re.fullmatch(r"scheduler plan v\d+|INFO watcher: plan v\d+", l)]
    assert len(lines) == 10000 and glued == [], glued[:5]


def test_every_flag_of_every_command_has_help_and_the_top_says_what_tierstack_is():
    parser = cli.build_parser()
    assert "GPU HBM, CPU DRAM and NVMe" in parser.description
    missing = []

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, sub_parser in action.choices.items():
                    assert sub_parser.description, f"{name} {sub} has no description"
                    walk(sub_parser, f"{name} {sub}")
            elif action.option_strings and not action.help:
                missing.append(f"{name} {action.option_strings[0]}")

    walk(parser, "tierstack")
    assert missing == []


# ---- tierstack plan ---------------------------------------------------------------------------

def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_plan_json_is_strict_and_a_model_that_does_not_fit_exits_1(capsys):
    code, out, err = _main(capsys, "plan", "--json", "--nodes", "1", "--nvme", "1TB",
                           "--cpu-memory", "100GB")
    assert code == 1, err
    result = _strict_json(out.strip().splitlines()[-1])["estimate"]
    assert result["fits"] is False and result["step_seconds"] is None and "NVMe" in result["reason"]
    code, out, _ = _main(capsys, "plan", "--nodes", "1", "--nvme", "1TB", "--cpu-memory", "100GB")
    assert code == 1 and "does NOT fit" in out


@pytest.mark.parametrize("argv, says", [
    (("--efficiency", "2"), "--efficiency: must be a fraction in (0, 1], got 2"),
    (("--params", "1e12", "--layers", "3"), "--params 1e+12 contradicts --layers 3 and --hidden 25600"),
    (("--nodes", "0"), "--nodes: must be a positive integer, got 0"),
    (("--gpu-memory", "0"), "--gpu-memory: must be more than 0 bytes"),
    (("--nvme-read", "inf"), "--nvme-read: 'inf' is not a finite number"),
])
def test_plan_refuses_bad_arguments_in_one_line(capsys, argv, says):
    assert says in _one_line_error(capsys, "plan", *argv)


# ---- tierstack doctor ----------------------------------------------------------------------

def test_doctor_names_what_is_wrong_and_what_to_do(capsys, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("x")
    code, out, _ = _main(capsys, "doctor", "--quick", "--nvme-path", str(file),
                         "--nvme-path", "/dev/shm")
    assert code == 1
    assert f"[fail] NVMe path {file}" in out and "is a file" in out
    assert "[warn] NVMe path /dev/shm" in out and "not durable" in out and "-> put nvme_pool.paths" in out
    for check in ("host memory", "CPU pool directory", "huge pages", "pinning", "GPU"):
        assert check in out
    assert "disk bandwidth" not in out  # --quick measures nothing


def test_doctor_measures_the_disk_and_passes_on_a_good_path(capsys, tmp_path):
    code, out, _ = _main(capsys, "doctor", "--nvme-path", str(tmp_path / "nvme"))
    assert "O_DIRECT works" in out
    line = next(l for l in out.splitlines() if "disk bandwidth" in l)
    write, read = (float(line.split(f"{k} ")[1].split(" GB/s")[0]) for k in ("write", "read"))
    assert write > 0 and read > 0
    assert not (tmp_path / "nvme").exists()  # the check cleans up after itself
    assert code == (1 if "[fail]" in out else 0)


def test_the_tier_manager_logs_the_doctor_checks_at_start(daemon):
    log = daemon.log_text()
    assert "doctor: ok: NVMe path" in log and "doctor: ok: host memory" in log


# ---- Hugging Face models, data, checkpoints, progress ----------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 256, "max_position_embeddings": 64}
SMALL = ("--seq-len", "32", "--batch-size", "2", "--cpu-pool-size", "4MiB", "--no-scheduler")


def _train(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "tierstack.cli", "train", *args,
                          "--nvme-path", str(tmp_path / "nvme")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _train_side_by_side(tmp_path, *runs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`tierstack train` runs that do not depend on each other, at the same time (two jobs
    on one machine, each with its embedded daemon): most of a tiny run is its Python
    importing torch and transformers, one core's work. Their results, in order; the exit
    status is the caller's to check."""
    procs = []
    try:
        for argv in runs:
            out = tmp_path / f"train-{uuid.uuid4().hex[:8]}"
            with open(f"{out}.out", "w") as stdout, open(f"{out}.err", "w") as stderr:
                procs.append((out, subprocess.Popen(
                    [sys.executable, "-m", "tierstack.cli", "train", *argv,
                     "--nvme-path", str(tmp_path / "nvme")], stdout=stdout, stderr=stderr)))
        for _, proc in procs:
            proc.wait(timeout=300)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [subprocess.CompletedProcess(proc.args, proc.returncode, Path(f"{out}.out").read_text(),
                                        Path(f"{out}.err").read_text()) for out, proc in procs]


def test_a_hugging_face_model_trains_checkpoints_resumes_bit_for_bit_and_exports(tmp_path):
    """LLaMA from a config directory: 4 steps straight equal 2 steps, then a resume to 4
    (same weights and moments, bit for bit), and the export loads with from_pretrained."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    hf = ("--hf-model", str(model_dir), *SMALL)
    straight, half = _train_side_by_side(
        tmp_path, (*hf, "--steps", "4", "--checkpoint-dir", str(tmp_path / "a")),
        (*hf, "--steps", "2", "--checkpoint-dir", str(tmp_path / "b")))
    for out in (straight, half):
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "LlamaForCausalLM (llama) 2 x 64" in straight.stdout and "initialised from its config" in straight.stdout
    # The resume to step 4, and beside it a resume that does not match its checkpoint (a's,
    # saved with --seq-len 32), which says what differs.
    resumed, bad = _train_side_by_side(
        tmp_path, (*hf, "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                   "--export", str(tmp_path / "hf")),
        (*hf, "--steps", "6", "--seq-len", "16", "--checkpoint-dir", str(tmp_path / "a"), "--resume"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'b' / 'global_step2'} after step 2" in resumed.stdout
    assert bad.returncode == 2 and "seq_len 32" in bad.stderr and "resume with the flags" in bad.stderr
    # One layout, the engine's: a tag per checkpoint and `latest`; the newest kept.
    for run in "ab":
        assert sorted(os.listdir(tmp_path / run)) == ["global_step4", "latest"]
        assert (tmp_path / run / "latest").read_text() == "global_step4"
    a, b = tmp_path / "a" / "global_step4", tmp_path / "b" / "global_step4"
    for name in ["persistent.safetensors"] + [f"block-{i:05d}.safetensors" for i in range(2)]:
        saved_a, saved_b = load_file(str(a / name)), load_file(str(b / name))
        assert saved_a.keys() == saved_b.keys() and all(torch.equal(saved_a[k], saved_b[k]) for k in saved_a)
    exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    block0 = load_file(str(a / "block-00000.safetensors"))
    assert torch.equal(exported.model.layers[0].mlp.up_proj.weight, block0["mlp.up_proj.weight"])
    # tierstack zero-to-fp32 reads the run's checkpoint (its latest tag) into what
    # from_pretrained loads: the export's weights, every one.
    fp32 = subprocess.run([sys.executable, "-m", "tierstack.cli", "zero-to-fp32", str(tmp_path / "b"),
                           str(tmp_path / "fp32"), "--safetensors"], capture_output=True, text=True, timeout=300)
    assert fp32.returncode == 0, fp32.stdout + fp32.stderr
    consolidated = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "fp32")).state_dict()
    assert consolidated.keys() == exported.state_dict().keys()
    assert all(torch.equal(consolidated[k], v) for k, v in exported.state_dict().items())
    # The export is a model directory with weights: training can start from it. With no
    # --cpu-pool-size the pools' caps are the machine's budgets: nothing sized by hand.
    unsized = tuple(a for a in SMALL if a not in ("--cpu-pool-size", "4MiB"))
    again = _train(tmp_path, "--hf-model", str(tmp_path / "hf"), *unsized, "--steps", "1")
    assert f"weights from {tmp_path / 'hf'}" in again.stdout
    assert "CPU pool up to the machine's budget -> NVMe up to the machine's budget" in again.stdout
    # ... and the main job's state still streams through NVMe however large the pool.
    assert min(_nvme_volumes(again.stdout)) > 0, again.stdout[-500:]


def test_gpt2_from_a_json_config_on_a_text_file_logs_whole_plain_lines(tmp_path):
    """Not a terminal: one complete line per --log-every interval (0: every step), never
    cut to the terminal's width, and the summary."""
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64).to_dict()))
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = _train(tmp_path, "--hf-model", str(config), "--data", str(text), *SMALL[:-1],
                 "--steps", "3", "--log-every", "0", env={"COLUMNS": "40"})
    lines = out.stdout.splitlines()
    steps = [l for l in lines if l.startswith("step ")]
    assert [l.split()[1] for l in steps] == ["1/3", "2/3", "3/3"]
    for line in steps:
        assert all(f" {k} " in line for k in ("nvme->cpu", "cpu->nvme", "cpu->dev", "dev->cpu"))
        assert "tok/s" in line and "stall" in line and "ETA" in line and len(line) > 40
    assert any(l.startswith("scheduler plan v1:") for l in lines)
    assert any(l.startswith("done: 3 steps") and "device budget peak" in l for l in lines)
    assert f"data {text} as bytes" in out.stdout


def test_a_terminal_gets_a_progress_bar_with_an_eta():
    import pty

    from tierstack.worker.jobs.progress import TrainProgress
    from tierstack.worker.engine.training_loop import StepRecord

    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 200, 0, 0))  # 200 columns
    with os.fdopen(slave, "w") as terminal:
        progress = TrainProgress(4, 1024, out=terminal)
        assert progress.tty
        for i in range(4):
            progress.step(StepRecord(i, 5.0 - i, 0.5, moved={"nvme_read": 1e9, "to_device": 2e9,
                                                             "stalled": 0.25}))
        progress.close()
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    text = shown.decode(errors="replace")
    assert "step 4/4" in text and "ETA" in text and "\x1b[" in text  # a live bar, not lines
    assert "loss 2.0000" in text and "2,048 tok/s" in text and "nvme->cpu 2.00" in text
    assert "cpu->dev 4.00" in text and "stall 50%" in text


def _left_behind(tmp_path: Path, job: str, pid: int) -> str:
    """A run index entry (under $XDG_STATE_HOME, which the caller points at tmp_path/state)
    for run `pid` with a directory holding 1 MiB: what a run killed before it cleaned up
    leaves when `pid` is a process that is gone. Returns the directory."""
    from tierstack.run_index import RunRecord, new_index_file, write_record

    directory = tmp_path / "nvme" / f"{job}-{pid}"
    directory.mkdir(parents=True)
    (directory / "pool.0").write_bytes(b"x" * (1 << 20))
    record = RunRecord(job, pid, socket.gethostname(), time.time() - 120, [str(directory)])
    write_record(new_index_file(record), record)
    return str(directory)


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: nothing has this pid now
    return proc.pid


def test_jobs_with_no_tier_manager_makes_no_call_and_lists_the_runs_left_behind(capsys, tmp_path,
                                                                               monkeypatch):
    """`tierstack jobs` with no daemon used to wait out the client's 10 s deadline and end in
    DEADLINE_EXCEEDED. A unix socket that is not there, or that nothing listens on (a
    killed daemon's), is now told without a gRPC client being made at all, so no call can
    wait; the runs killed runs left are listed as `tierstack doctor` lists them, and
    `jobs --clean` removes them, with no daemon either."""
    from tierstack.rpc import RpcClient

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    dead = _left_behind(tmp_path, "dead-job", _gone_pid())
    _left_behind(tmp_path, "live-job", os.getpid())

    def no_client(*args, **kwargs):
        raise AssertionError("a gRPC client was made: its first call would wait for a daemon")

    monkeypatch.setattr(RpcClient, "__init__", no_client)
    missing = tmp_path / "tm.sock"
    stale = tmp_path / "stale.sock"
    killed = socket.socket(socket.AF_UNIX)
    killed.bind(str(stale))  # bound, never listening: what a SIGKILLed daemon leaves
    try:
        for address, why in ((f"unix:{missing}", f"{missing} does not exist"),
                             (str(stale), f"nothing listens on {stale}")):
            monkeypatch.setenv("TIERSTACK_TIER_MANAGER", address)
            code, out, err = _main(capsys, "jobs")
            assert code == 0 and err == "", err
            first, left, *runs = out.splitlines()
            assert first.startswith(f"no tier manager at {address} ({why}") and \
                "start one with `tierstack tier-manager`" in first, first
            assert "runs left behind: 1 run(s)" in left and "`tierstack jobs --clean`" in left, left
            assert len(runs) == 1 and "job dead-job (pid" in runs[0] and "2 min ago" in runs[0] \
                and dead in runs[0] and "0.00 GiB" in runs[0], runs

            line = _one_line_error(capsys, "jobs", "--delete", "dead-job")
            assert line.startswith(f"tierstack: no tier manager at {address} ({why}") and \
                "start it (`tierstack tier-manager`)" in line, line
    finally:
        killed.close()
    code, out, _ = _main(capsys, "jobs", "--clean")
    assert code == 0 and f"job dead-job (pid " in out and f"removed {dead}" in out, out
    assert not Path(dead).exists()
    code, out, _ = _main(capsys, "jobs")
    assert code == 0 and out.splitlines()[1] == "runs left behind: none", out


def test_jobs_with_no_tier_manager_on_tcp_says_so_after_a_short_connect(capsys, tmp_path, monkeypatch):
    """A TCP address gets JOBS_REACH_SECONDS to connect, not the 10 s of a call."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    code, out, _ = _main(capsys, "jobs", "--tier-manager", address)
    assert code == 0 and out.startswith(
        f"no tier manager at {address} (nothing answered within {cli.JOBS_REACH_SECONDS:g} s"), out
    assert out.splitlines()[-1] == "runs left behind: none"


def test_jobs_lists_a_nodes_jobs_and_deletes_one(daemon, capsys, tmp_path, monkeypatch):
    from tierstack.services.tier_manager.client import TierManagerClient

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    dead = _left_behind(tmp_path, "killed-run", _gone_pid())
    worker = TierManagerClient(daemon.address, reconnect_timeout=10)
    worker.open_job("pretrain", keep=True)
    worker.open_job("sweep-3", quota_bytes=64 << 20)
    assert cli.main(["jobs", "--tier-manager", daemon.address]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out[1:]}
    assert "kept" in rows["pretrain"] and "open" in rows["sweep-3"] and "quota 64 MiB" in rows["sweep-3"]
    # The daemon's jobs, then what killed runs left on this machine's disks.
    assert out[-2].startswith("runs left behind: 1 run(s)") and "job killed-run" in out[-1] \
        and dead in out[-1], out
    assert cli.main(["jobs", "--tier-manager", daemon.address, "--delete", "pretrain", "--force"]) == 0
    assert "job pretrain: 0 tensors deleted" in capsys.readouterr().out
    worker.close()


def test_train_honours_a_deepspeed_jsons_nvme_path_schedule_and_fp16(tmp_path):
    """The JSON's nvme_path holds the job's pool (a directory named by the job, removed at
    the end), its scheduler moves the lr, fp16 trains with loss scaling."""
    nvme = tmp_path / "ds-nvme"
    ds = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3,
                                "offload_param": {"device": "nvme", "nvme_path": str(nvme),
                                                  "max_in_cpu": 0},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2,
                                                            "total_num_steps": 4,
                                                            "warmup_max_lr": 3e-3}},
          "fp16": {"enabled": True, "initial_scale_power": 8}}
    out = _train_cli(tmp_path, ds, "--steps", "4", "--layers", "2", "--dim", "32", "--heads", "2",
                     "--seq-len", "16", "--no-scheduler", "--log-every", "0")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(rf"NVMe up to .* at {re.escape(str(nvme))}/train-\d+", out.stdout), out.stdout[:800]
    assert "done: 4 steps" in out.stdout and _nvme_volumes(out.stdout) > (0, 0)
    assert not nvme.exists()


def test_train_with_a_stated_hbm_budget_on_a_machine_without_one_names_the_budget(tmp_path):
    """budgets reach the job: an HBM budget on a CPU-only machine is refused by name."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: any HBM budget up to its memory is fine")
    out = _train_cli(tmp_path, {"budgets": {"hbm": "1GiB"}}, "--steps", "1", "--layers", "2",
                     "--dim", "32", "--heads", "2", "--seq-len", "16", "--no-scheduler",
                     "--nvme-path", str(tmp_path / "n"), timeout=300)
    assert out.returncode == 2, out.stdout[-1000:] + out.stderr[-1000:]
    assert "budgets.hbm is 1.0 GiB but the device's memory is 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_ctrl_c_with_a_checkpoint_dir_checkpoints_at_the_step_in_progress(tmp_path):
    """Ctrl-C (SIGINT to the job's process group) with --checkpoint-dir ends the job as
    SIGTERM does: after the step in progress, a checkpoint at that step, exit 130."""

    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    flags = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
             "--no-scheduler", "--log-every", "0", "--nvme-path", str(nvme), "--checkpoint-dir", str(ckpt)]
    out = _train_then_stop(flags, lambda proc: os.killpg(proc.pid, signal.SIGINT), 130)
    stopped = re.search(r"stopped by SIGINT after step (\d+) of 100000", out)
    assert stopped, out[-2000:]
    tag = f"global_step{stopped.group(1)}"
    assert f"checkpoint: {ckpt / tag} (step {stopped.group(1)})" in out
    assert (ckpt / "latest").read_text() == tag and (ckpt / tag / "engine.pt").exists()
    assert not nvme.exists()
