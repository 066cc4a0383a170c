"""DeepSpeed's module surface on tierstack's engine: a DeepSpeed script run with only its import
changed (tests/worker/scripts/ds_surface_script.py, in its own process, against a real tier
manager), its step lines and monitor files against the losses it computed and plain
PyTorch's, and each name's answers and refusals."""

from __future__ import annotations

import copy
import csv
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

import tierstack
from tierstack import checkpointing
from tierstack.accelerator import get_accelerator
from tierstack.config import load_config
from tierstack.errors import ConfigError
from tierstack.ops.adam import DeepSpeedCPUAdam, FusedAdam

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "ds_surface_script.py"
_spec = importlib.util.spec_from_file_location("ds_surface_model", SCRIPTS / "ds_surface_model.py")
model_file = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_file)

ACCUMULATION, STEPS = 2, 4
HYPER = {"lr": 2e-3, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.05}  # the script's


def _config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": model_file.ROWS,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        **sections}))
    return path


def _run_script(tmp_path: Path, address: str, config: Path, *args: str, ranks: int = 1
                ) -> tuple[list[dict], str]:
    """The script as `python train.py --deepspeed_config ...` runs it (several ranks: as
    torchrun runs it): (each rank's REPORT by rank, everything the ranks printed)."""
    launcher = [sys.executable]
    env = {**os.environ, "TIERSTACK_TIER_MANAGER": address}
    if ranks > 1:
        from tierstack.worker.node.distributed import free_port

        # Each rank's streams to a file of its own: on one shared pipe, two unbuffered ranks'
        # lines can interleave (PYTHONUNBUFFERED writes a line's text and newline apart).
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                     "--master-port", str(free_port()), "--redirects", "3",
                     "--log-dir", str(tmp_path / "ranks")]
        # One job name for the ranks (tierstack launch sets it too); torchrun's agent keeps
        # its logs in TMPDIR: a short one of the test's own.
        env.update(TIERSTACK_JOB=f"surface-{os.getpid()}", TMPDIR=str(tmp_path))
    out = subprocess.run([*launcher, str(SCRIPT), "--deepspeed", "--deepspeed_config",
                          str(config), "--steps", str(STEPS), *args],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    streams = [out.stdout] + [p.read_text() for p in sorted((tmp_path / "ranks").rglob("std*.log"))]
    printed = "".join(streams) + out.stderr
    assert out.returncode == 0, printed[-4000:]
    reports = sorted((json.loads(line[len("REPORT "):]) for text in streams
                      for line in text.splitlines() if line.startswith("REPORT ")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(ranks)), printed[-4000:]
    return reports, printed


def _plain_pytorch_losses() -> list[float]:
    """The script's training in plain PyTorch: the same seed, data, loss and AdamW."""
    torch.manual_seed(0)
    model = model_file.Net()
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    losses = []
    batches = model_file.batches(1, STEPS * ACCUMULATION)
    for step in range(STEPS):
        for ids in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            loss = model_file.loss_of(model(ids), ids)
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _step_means(losses: list[float]) -> list[float]:
    """Each optimizer step's loss as the script's micro-batches give it (their mean)."""
    return [sum(losses[i:i + ACCUMULATION]) / ACCUMULATION for i in range(0, len(losses), ACCUMULATION)]


def test_a_deepspeed_script_runs_with_only_its_import_changed_and_reports_as_deepspeed(
        shared_daemon, tmp_path):
    """`import tierstack as deepspeed`, then deepspeed.accelerator, deepspeed.comm,
    deepspeed.ops.adam, checkpointing, DeepSpeedConfig, DeepSpeedEngine and __version__ as
    the script uses them: it trains as plain PyTorch does with DeepSpeedCPUAdam's
    hyper-parameters; steps_per_print lines at steps 2 and 4 (and DeepSpeed's step 0);
    wall_clock_breakdown's timers after every micro step and step; the CSV and TensorBoard
    files hold the script's own losses; the tools tierstack lacks warn once each."""
    config = _config(
        tmp_path, steps_per_print=2, wall_clock_breakdown=True,
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
        tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
        wandb={"enabled": True, "project": "p", "group": None},
        flops_profiler={"enabled": True, "profile_step": 1}, comms_logger={"enabled": True})
    (report,), printed = _run_script(tmp_path, shared_daemon.address, config)

    # The names' answers, as DeepSpeed's CPU accelerator and one-rank comm give them.
    assert report["version"] == version("tierstack") == tierstack.__version__
    assert (report["device"], report["device_name"], report["backend"]) == ("cpu", "cpu", "gloo")
    assert report["device_count"] == 1 and report["available"] is True
    assert 0 < report["memory_allocated"] <= report["max_memory_allocated"]
    assert (report["rank"], report["world_size"], report["local_rank"]) == (0, 1, 0)
    assert report["dist_initialized"] is False  # one rank: no process group, as torch says
    assert report["gathered"] == [0.0] and report["broadcast"] == 7.0
    assert report["reduced"] == report["losses"]  # a world of one reduces to itself
    assert report["checkpointing_configured"] is True
    assert report["config"] == {"train_batch_size": model_file.ROWS * ACCUMULATION,
                                "micro": model_file.ROWS, "accumulation": ACCUMULATION, "stage": 3,
                                "fp16": False, "bf16": False, "steps_per_print": 2}
    assert report["mom"] == [list(HYPER["betas"])] and report["lr"] == [HYPER["lr"]]
    assert report["global_steps"] == STEPS and report["global_samples"] == STEPS * 8

    # DeepSpeedCPUAdam's hyper-parameters are the tier managers' AdamW: plain PyTorch's losses.
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(_plain_pytorch_losses()),
                               rtol=1e-5, atol=0)

    # steps_per_print: DeepSpeed's line at step 0 (initialize), then every 2nd step, each with
    # the throughput line; no other step is printed.
    steps = [int(s) for s in re.findall(r"\[Rank 0\] step=(\d+), skipped=0, lr=\[0\.002\], "
                                        r"mom=\[\(0\.8, 0\.99\)\]", printed)]
    assert steps == [0, 2, 4], printed[-3000:]
    throughput = re.findall(r"epoch=0/micro_step=(\d+)/global_step=(\d+), RunningAvgSamplesPerSec="
                            r"\S+, CurrSamplesPerSec=[\d.]+, MemAllocated=[\d.]+GB, "
                            r"MaxMemAllocated=[\d.]+GB", printed)
    assert throughput == [("4", "2"), ("8", "4")]

    # wall_clock_breakdown: every micro step's timers, and each optimizer step's sums.
    micro = re.findall(r"\[Rank 0\] time \(ms\) \| fwd_microstep: ([\d.]+) \| bwd_microstep: "
                       r"([\d.]+) \| bwd_inner_microstep: [\d.]+ \| bwd_allreduce_microstep: "
                       r"0\.00 \| step_microstep: [\d.]+", printed)
    window = re.findall(r"\[Rank 0\] time \(ms\) \| fwd: ([\d.]+) \| bwd: ([\d.]+) \| bwd_inner: "
                        r"[\d.]+ \| bwd_allreduce: 0\.00 \| step: [\d.]+", printed)
    assert len(micro) == STEPS * ACCUMULATION and len(window) == STEPS
    assert all(float(f) > 0 and float(b) > 0 for f, b in micro + window)

    # Tools tierstack does not have: one line each, training went on.
    assert printed.count("flops_profiler: the FLOPs profiler is not part of tierstack") == 1
    assert printed.count("comms_logger: the communication logger is not part of tierstack") == 1
    assert printed.count("wandb.enabled: the wandb package is not installed") == 1

    # The monitors: DeepSpeed's event names at the samples trained, the script's own losses.
    expected = _step_means(report["losses"])
    samples = [8 * (s + 1) for s in range(STEPS)]
    rows = _csv(tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == samples
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(expected, rel=1e-6)
    assert _csv(tmp_path / "csv" / "run" / "Train_Samples_lr.csv")[1:] == [[str(s), "0.002"] for s in samples]
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        timed = _csv(tmp_path / "csv" / "run" / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert timed[0] == ["step", f"elapsed_time_ms_{name}"] and len(timed) == STEPS + 1
    forward_ms = [float(r[1]) for r in _csv(tmp_path / "csv" / "run" /
                                            "Train_Samples_elapsed_time_ms_forward.csv")[1:]]
    assert forward_ms == pytest.approx([float(f) for f, _ in window], abs=0.01)
    # The script's own event through engine.monitor.
    assert _csv(tmp_path / "csv" / "run" / "Train_Eval_loss.csv") == [
        ["step", "loss"], [str(samples[-1]), str(report["losses"][-1])]]

    scalars = _tensorboard(tmp_path / "tb" / "run")
    assert [step for step, _ in scalars["Train/Samples/train_loss"]] == samples
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx(expected, rel=1e-6)
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx([0.002] * STEPS)
    assert "Train/Samples/elapsed_time_ms_step" in scalars and "Train/Eval/loss" in scalars


def test_fused_adam_and_checkpoint_in_cpu_train_the_same_and_print_nothing_unasked(
        shared_daemon, tmp_path):
    """FusedAdam is the same AdamW; checkpointing.configure(checkpoint_in_cpu=True) sends the
    offloaded blocks' inputs to the CPU pool, which changes no number; a config without
    steps_per_print or monitors prints no step line and writes no file."""
    (report,), printed = _run_script(tmp_path, shared_daemon.address, _config(tmp_path),
                                     "--optimizer", "fused_adam", "--checkpoint-in-cpu")
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(_plain_pytorch_losses()),
                               rtol=1e-5, atol=0)
    assert "step=" not in printed and "time (ms)" not in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds_config.json"]


def test_under_torchrun_comm_is_the_jobs_process_group_and_rank_0_alone_reports(
        shared_daemon, tmp_path):
    """Two ranks (torchrun, each with its own rows): deepspeed.comm's calls are the process
    group's (the all-reduced loss is the ranks' mean, a gather holds both ranks); the step
    lines, timers and monitor files come from rank 0 only, counting both ranks' samples, and
    wall_clock_breakdown times the gradients' collectives."""
    config = _config(tmp_path, steps_per_print=4, wall_clock_breakdown=True,
                     csv_monitor={"enabled": True, "output_path": "csv", "job_name": "run"})
    reports, printed = _run_script(tmp_path, shared_daemon.address, config, ranks=2)
    for report in reports:
        assert report["world_size"] == 2 and report["dist_initialized"] is True
        assert report["gathered"] == [0.0, 1.0] and report["broadcast"] == 7.0
        assert report["config"]["train_batch_size"] == 2 * model_file.ROWS * ACCUMULATION
    zero, one = reports
    assert zero["losses"] != one["losses"]  # their own rows
    assert zero["reduced"] == one["reduced"] == pytest.approx(
        [(a + b) / 2 for a, b in zip(zero["losses"], one["losses"])], rel=1e-6)
    assert printed.count("[Rank 0] step=4, skipped=0") == 1 and "[Rank 1]" not in printed
    assert printed.count("global_step=4, RunningAvgSamplesPerSec=") == 1
    window = re.findall(r"\[Rank 0\] time \(ms\) \| fwd: [\d.]+ \| bwd: [\d.]+ \| bwd_inner: "
                        r"[\d.]+ \| bwd_allreduce: ([\d.]+) \| step: [\d.]+", printed)
    assert len(window) == STEPS and all(float(ms) > 0 for ms in window)
    rows = _csv(tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv")
    assert [int(r[0]) for r in rows[1:]] == [16 * (s + 1) for s in range(STEPS)]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(_step_means(zero["losses"]), rel=1e-6)


def _csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# ---- the aliased imports ----------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_alias_serves_only_the_code_that_made_it_and_a_missing_name_fails_in_one_line():
    """After `import tierstack as deepspeed`, `deepspeed.X` imports are tierstack's; code
    that did not alias (transformers probing for DeepSpeed) finds what is really installed
    (the real DeepSpeed, which the checkpoint tests install, or nothing); a DeepSpeed module
    tierstack lacks is one ModuleNotFoundError line naming the alternative."""
    real = _python("import importlib.util\nspec = importlib.util.find_spec('deepspeed')\n"
                   "print(spec.origin if spec else None)\n").stdout.strip()
    out = _python(
        "import importlib.util, tierstack\n"
        "spec = importlib.util.find_spec('deepspeed')  # not aliased here: the real one or none\n"
        f"assert str(spec.origin if spec else None) == {real!r}, spec\n"
        "import tierstack as deepspeed\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "import deepspeed.comm as dist\n"
        "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
        "from deepspeed import checkpointing, DeepSpeedConfig, DeepSpeedEngine\n"
        "import tierstack.accelerator, tierstack.comm, tierstack.ops.adam\n"
        "assert get_accelerator is tierstack.accelerator.get_accelerator\n"
        "assert dist is tierstack.comm and DeepSpeedCPUAdam is tierstack.ops.adam.DeepSpeedCPUAdam\n"
        "assert importlib.util.find_spec('tierstack').name == 'tierstack'\n"
        "print('ok', deepspeed.__version__)\n"
        "from deepspeed.pipe import PipelineModule\n")
    assert out.stdout.startswith("ok "), out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: tierstack does not provide deepspeed.pipe: pipeline "
                           "parallelism is not supported"), out.stderr
    plain = _python("import tierstack\nimport deepspeed\nprint(deepspeed.__file__)\n")
    if real == "None":
        assert plain.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'deepspeed'"
    else:  # not aliased: the installed DeepSpeed, not tierstack
        assert plain.stdout.strip().splitlines()[-1] == real, plain.stderr[-2000:]


@pytest.mark.parametrize("reach,message", [
    (lambda: tierstack.init_inference, r"^tierstack does not provide deepspeed.init_inference: "
                                       r"DeepSpeed's inference engine is not part of tierstack; "
                                       r"evaluate with engine.eval\(\)"),
    (lambda: tierstack.PipelineModule, r"^tierstack does not provide deepspeed.PipelineModule: pipeline"),
    (lambda: tierstack.no_such_name, r"^module 'tierstack' has no attribute 'no_such_name' \(tierstack "
                                     r"provides DeepSpeed's initialize"),
    (lambda: tierstack.comm.send, r"^tierstack.comm has no send: .*; call torch.distributed.send"),
    (lambda: get_accelerator().create_graph, r"^tierstack's accelerator has no create_graph\(\)"),
    (lambda: checkpointing.get_cuda_rng_tracker, r"^tierstack.checkpointing has no "
                                                 r"get_cuda_rng_tracker: model parallelism"),
    (lambda: tierstack.ops.transformer, r"^tierstack.ops has no transformer"),
])
def test_a_name_tierstack_does_not_provide_fails_in_one_line_naming_the_alternative(reach, message):
    with pytest.raises(AttributeError, match=message) as err:
        reach()
    assert "\n" not in str(err.value)


def test_the_top_names_are_the_engine_and_config_and_the_version_is_the_packages():
    from tierstack.worker.api.training_engine import TrainingEngine

    assert tierstack.DeepSpeedEngine is TrainingEngine
    assert tierstack.DeepSpeedConfigError is ConfigError
    assert tierstack.get_accelerator() is get_accelerator()
    assert tierstack.__version__ == version("tierstack")
    assert (tierstack.__version_major__, tierstack.__version_minor__) == tuple(
        int(p) for p in version("tierstack").split(".")[:2])


# ---- each name's answers ------------------------------------------------------------------------


def test_the_cpu_accelerator_answers_as_deepspeeds_with_the_processs_memory():
    accelerator = get_accelerator()
    assert (accelerator.device_name(), accelerator.device_name(0)) == ("cpu", "cpu")
    assert accelerator.current_device() == int(os.environ.get("LOCAL_RANK", 0))
    accelerator.reset_peak_memory_stats()
    before = accelerator.memory_allocated()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert accelerator.memory_allocated() >= before + (60 << 20)
    del block
    assert accelerator.max_memory_allocated() >= before + (60 << 20)
    accelerator.reset_peak_memory_stats()  # the block is unmapped: the peak starts again below it
    assert accelerator.max_memory_allocated() < before + (60 << 20)
    assert accelerator.total_memory() > accelerator.available_memory() > 0
    assert accelerator.Stream is None and accelerator.synchronize() is None
    accelerator.manual_seed(3)
    a = torch.rand(2)
    accelerator.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert accelerator.on_accelerator(a) and accelerator.supported_dtypes() == [torch.float, torch.bfloat16]


def test_the_deepspeed_config_object_derives_the_batch_as_deepspeed_does(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "gradient_clipping": 1.0, "steps_per_print": 50,
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}))
    config = tierstack.DeepSpeedConfig(str(path))
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps, config.world_size) == (32, 4, 4, 2)
    assert config.bfloat16_enabled and not config.fp16_enabled and config.gradient_clipping == 1.0
    assert (config.zero_enabled, config.zero_optimization_stage) == (True, 3)
    assert (config.optimizer_name, config.optimizer_params) == ("adamw", {"lr": 1e-4})
    assert (config.scheduler_name, config.steps_per_print) == ("WarmupLR", 50)
    assert config.wall_clock_breakdown is False and config._param_dict["bf16"] == {"enabled": True}
    with pytest.raises(ConfigError, match=r"^train_batch_size 30 is not a multiple"):
        tierstack.DeepSpeedConfig({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                                   "zero_optimization": {"stage": 3}})


def test_deepspeeds_adam_classes_step_as_torch_and_refuse_what_the_tiers_do_not_do():
    """DeepSpeedCPUAdam and FusedAdam step as torch's AdamW (adamw_mode) or Adam with L2
    (adamw_mode=False); what the tier managers' AdamW cannot do is refused in one line."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    for make, decoupled in ((lambda p: DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.1), True),
                            (lambda p: FusedAdam(p, lr=0.1, weight_decay=0.1, adam_w_mode=False), False)):
        a = make(ours.parameters())
        b = (torch.optim.AdamW if decoupled else torch.optim.Adam)(theirs.parameters(), lr=0.1,
                                                                   weight_decay=0.1)
        for _ in range(3):
            for model, opt in ((ours, a), (theirs, b)):
                opt.zero_grad()
                model(torch.ones(2, 4)).square().sum().backward()
                opt.step()
        torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"^DeepSpeedCPUAdam\(bias_correction=False\) is not supported"):
        DeepSpeedCPUAdam(ours.parameters(), bias_correction=False)
    with pytest.raises(ConfigError, match=r"^FusedAdam\(amsgrad=True\) is not supported"):
        FusedAdam(ours.parameters(), amsgrad=True)


def test_an_l2_deepspeed_adam_is_refused_by_initialize_and_configure_sets_the_next_engines_policy(
        shared_daemon, monkeypatch):
    model = model_file.Net()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match=r"^initialize: DeepSpeedCPUAdam\(adamw_mode=False\) with "
                                          r"weight_decay adds the decay to the gradient \(L2\).*use "
                                          r"adamw_mode=True"):
        tierstack.initialize(model=model, config=config, tier_manager=shared_daemon.address,
                             optimizer=DeepSpeedCPUAdam(model.parameters(), weight_decay=0.1,
                                                        adamw_mode=False))
    monkeypatch.setattr(checkpointing, "_request", None)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": False}},
                            checkpoint_in_cpu=True)
    trained = copy.deepcopy(model)
    engine, _, _, _ = tierstack.initialize(model=trained, tier_manager=shared_daemon.address,
                                           config=config,
                                           optimizer=FusedAdam(trained.parameters(), weight_decay=0.0,
                                                               adam_w_mode=False))
    try:
        assert engine.core.activation_policy == "cpu"  # the argument over the file, as DeepSpeed
        block = engine.module.blocks[0]
        # An engine's block is run as it is (the engine recomputes it); anything else is
        # recomputed as torch.utils.checkpoint does, with the same gradients.
        x = torch.randn(2, 3, model_file.DIM, requires_grad=True)
        assert checkpointing._is_engine_block(block) and not checkpointing._is_engine_block(model.norm)
        norm = torch.nn.LayerNorm(model_file.DIM)
        checkpointing.checkpoint(norm, x).sum().backward()
        grad, x.grad = x.grad, None
        norm(x).sum().backward()
        torch.testing.assert_close(grad, x.grad)
    finally:
        engine.close()
        monkeypatch.setattr(checkpointing, "_request", None)


def test_an_optimizer_other_than_adam_names_deepspeeds_classes(shared_daemon):
    model = model_file.Net()
    with pytest.raises(ConfigError, match=r"tierstack.ops.adam.DeepSpeedCPUAdam / FusedAdam"):
        tierstack.initialize(model=model, config={"zero_optimization": {"stage": 3}},
                             tier_manager=shared_daemon.address,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_flops_profiler_and_comms_logger_warn_once_per_process(caplog, monkeypatch):
    from tierstack import deepspeed_config

    monkeypatch.setattr(deepspeed_config, "_warned", set())
    ds = {"zero_optimization": {"stage": 3}, "flops_profiler": {"enabled": True, "profile_step": 2},
          "comms_logger": {"enabled": True, "verbose": False}}
    with caplog.at_level(logging.WARNING, logger="tierstack.deepspeed_config"):
        load_config(ds)
        load_config(ds)
        load_config({**ds, "flops_profiler": {"enabled": False}})
    warned = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in warned] == ["flops_profiler", "comms_logger"]
    assert all("\n" not in m for m in warned)
