"""How long a sequence and how large a micro-batch train under one HBM budget: tierstack's
activation policies against DeepSpeed ZeRO-3's activation checkpointing.

The model, data and training are bench/vs_deepspeed.py's (a Hugging Face LlamaForCausalLM
from config, random tokens, bf16, sdpa, AdamW, clipping 1.0), with parameters and
optimizer state offloaded to the CPU on both sides (its `cpu` DeepSpeed JSON). Both sides
get the same HBM budget the same way: the child calls
torch.cuda.set_per_process_memory_fraction(budget / device memory) before anything is
allocated; tierstack also gets budgets.hbm = the budget (its placement packs to it).

- DeepSpeed: the JSON plus `activation_checkpointing` {partition_activations false,
  cpu_checkpointing true, contiguous_memory_optimization false, number_checkpoints null}.
  That section only acts where the model calls deepspeed.checkpointing.checkpoint, and
  DeepSpeed does not turn it on by itself, so the child does what Megatron-DeepSpeed
  does for its own model: deepspeed.checkpointing.configure(None, deepspeed_config=JSON),
  then Hugging Face's gradient checkpointing (use_reentrant true: DeepSpeed's checkpoint
  is the reentrant kind) with every layer's checkpoint function replaced by
  deepspeed.checkpointing.checkpoint. Each decoder layer's input then goes to CPU memory
  in the forward and comes back for its recompute in the backward.
- tierstack: the same JSON translated (tierstack/deepspeed_config.py), with
  train.activations.policy set to each of keep, recompute, cpu, nvme, auto.

For each side and policy the bench finds (1) the longest sequence at micro-batch 1 (in
multiples of --seq-step) and (2) the largest micro-batch at --seq, that train --steps
steps: sizes doubling from a start until one fails, then bisection. Each trial is a
fresh child process (its own CUDA context and allocator) with a timeout; a
torch.cuda.OutOfMemoryError, tierstack refusing the budget, a child that dies or one
that runs past its timeout counts as "does not fit" (the reason is in the trial's
record). The searches take turns one trial at a time, so when --budget-s runs out every
one has got as far as the others; sizes found by then are reported as lower bounds.
Then, time left, the tierstack policies run at DeepSpeed's largest sizes so tokens/s
compare at the same size. The last line printed is one JSON object (see `summary`).

On the GPU machine (torch 2.11, transformers, DeepSpeed carried as a wheel), about 10
minutes (the 540 s search budget plus one trial's timeout and start-up):
  source deploy/device_env.sh && python3 bench/activations.py --model 1.3b --hbm-gib 16 \\
      --quick --budget-s 540 --nvme-dir /var/tmp/actbench --out $OUT/activations.json
--quick searches DeepSpeed and tierstack's cpu and auto policies; drop it (and give
--budget-s more, over several runs with --sides/--policies subsets) for all five.

Without a GPU (--device cpu --sides ts) nothing caps the process's memory: the budget
is tierstack's alone (the machine's HBM ceiling is taken to be the budget), so a size
"does not fit" only when tierstack's placement refuses it (one step with every block
input sent to the tier manager would still pass budgets.hbm: same for every policy).
It tests the search and the plumbing, not memory:
  python bench/activations.py --device cpu --model tiny --sides ts --hbm-gib 0.02 \\
      --policies recompute,auto --max-seq 4096 --max-batch 8 --seq 256 --budget-s 120
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from footprint import Sampler, host_used_bytes  # noqa: E402
from tierstack.process_tree import kill_tree  # noqa: E402
from vs_deepspeed import MODELS, deepspeed_json, emit, run_deepspeed, run_tierstack  # noqa: E402

POLICIES = ("keep", "recompute", "cpu", "nvme", "auto")
GiB = 1 << 30
EXIT_GRACE_S = 20
"""Seconds a child that has written its result gets to exit (a daemon stopping) before
its process group is killed."""
CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": True,
                 "contiguous_memory_optimization": False, "number_checkpoints": None}


# ---- what each side trains with -------------------------------------------------------------


def checkpointing_json(micro: int) -> dict:
    """DeepSpeed's side: params and optimizer on the CPU, layer inputs checkpointed to CPU."""
    return {**deepspeed_json("cpu", micro, ""), "activation_checkpointing": dict(CHECKPOINTING)}


def tierstack_json(policy: str, micro: int, hbm: int) -> dict:
    """tierstack's side: DeepSpeed's JSON as tierstack reads it, the policy and the budget
    stated (the translation alone would say policy "cpu", budgets "auto")."""
    from tierstack.deepspeed_config import translate_deepspeed

    config = translate_deepspeed(checkpointing_json(micro))
    config["train"]["activations"] = {"policy": policy}
    config.setdefault("budgets", {})["hbm"] = hbm
    return config


def deepspeed_checkpointing(config: dict):
    """A `prepare(model)` for run_deepspeed: the JSON's activation_checkpointing in force
    for every decoder layer (module docstring)."""

    def prepare(model) -> None:
        import deepspeed

        deepspeed.checkpointing.configure(None, deepspeed_config=config)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        # Transformers 4.x calls the function on the LlamaModel, 5.x on each layer: every
        # module that holds one gets DeepSpeed's.
        swapped = 0
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
                swapped += 1
        if not swapped:
            raise RuntimeError("no module took a checkpoint function: this transformers "
                               "version checkpoints differently; update deepspeed_checkpointing")

    return prepare


# ---- one trial (a child process) ------------------------------------------------------------


def _cap_device_memory(hbm: int, device: str) -> None:
    """Hold the caching allocator to the budget, before anything is allocated."""
    import torch

    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, hbm / total), 0)


def _cpu_limits(hbm: int, nvme_dir: str):
    """The machine's ceilings with the HBM budget as its device memory (there is none)."""
    from dataclasses import replace

    from tierstack.budgets import measure

    return replace(measure(nvme_dir, "cpu"), hbm=hbm)


def _why_not(error: BaseException) -> str:
    """Why a trial did not fit: 'oom', 'budget' (tierstack refused the HBM budget) or
    'error' (anything else: a bug, worth a look), with the message."""
    import torch

    seen, e = [], error
    while e is not None and e not in seen:
        seen.append(e)
        text = f"{type(e).__name__}: {e}"
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            return "oom: " + text[:300]
        if type(e).__name__ == "ConfigError" and "budgets.hbm" in str(e):
            return "budget: " + text[:300]
        e = e.__cause__ or e.__context__
    return f"error: {type(error).__name__}: {str(error)[:300]}"


def child(spec_path: str) -> int:
    """Run one trial as the spec says; its result (or why it failed) goes to spec["result"]."""
    spec = json.loads(Path(spec_path).read_text())
    args = SimpleNamespace(**{k: spec[k] for k in ("model", "seq", "micro", "steps", "device",
                                                   "nvme_dir", "port")})
    try:
        _cap_device_memory(spec["hbm"], spec["device"])
        if spec["side"] == "ds":
            out = run_deepspeed(args, spec["config"], prepare=deepspeed_checkpointing(spec["config"]))
        else:
            limits = None if spec["device"].startswith("cuda") else _cpu_limits(spec["hbm"], args.nvme_dir)
            out = run_tierstack(args, spec["config"], limits=limits)
        finite = all(math.isfinite(loss) for loss in out["losses"])
        out.update(fits=finite, reason="" if finite else "non-finite loss")
    except Exception as e:  # noqa: BLE001 - a trial that does not fit is a result
        out = {"fits": False, "reason": _why_not(e)}
    Path(spec["result"]).write_text(json.dumps(out))
    return 0


# ---- the search (this process) --------------------------------------------------------------


@dataclass
class Trial:
    """One child's outcome, as the final JSON lists it."""

    key: str
    dim: str
    micro: int
    seq: int
    fits: bool
    reason: str = ""
    tokens_per_s: float | None = None
    step_s: list[float] = field(default_factory=list)
    gpu_peak: int = 0
    host_peak: int = 0
    wall_s: float = 0.0
    placement: dict | None = None
    phases: list = field(default_factory=list)
    """tierstack's per-step split of the step's time (bench/vs_deepspeed.py's `phases`)."""


@dataclass
class Search:
    """Doubling from `start` until a size fails or `cap` fits, then bisection on multiples
    of `unit`. `lo`: the largest size that fitted (0: none yet), `hi`: the smallest that
    did not (None: none yet)."""

    key: str
    dim: str  # "seq" (micro-batch 1) or "batch" (at the fixed sequence)
    start: int
    unit: int
    cap: int
    lo: int = 0
    hi: int | None = None
    tried: int = 0
    out_of_time: bool = False

    def next_size(self) -> int | None:
        """The next size to try, or None when the search is done."""
        if self.out_of_time:
            return None
        if self.hi is None:
            if self.tried == 0:
                return min(self.start, self.cap)
            return None if self.lo >= self.cap else min(2 * self.lo, self.cap)
        if self.hi - self.lo <= self.unit:
            return None
        mid = (self.lo + self.hi) // 2 // self.unit * self.unit
        return max(mid, self.lo + self.unit)

    def record(self, size: int, fits: bool) -> None:
        self.tried += 1
        if fits:
            self.lo = max(self.lo, size)
        else:
            self.hi = size if self.hi is None else min(self.hi, size)

    def status(self) -> str:
        """'exact', 'capped' (the cap fitted), 'out_of_time' (a lower bound), 'none_fit'."""
        if self.out_of_time:
            return "out_of_time"
        if self.hi is None:
            return "capped"
        return "exact" if self.lo else "none_fit"


class TrialRunner:
    """Starts each trial as a child in its own process group and working directories, and
    removes them (and any CPU pool arena a killed daemon left) whatever happens."""

    def __init__(self, args, workdir: Path, nvme_root: Path, deadline: float) -> None:
        self.args, self.workdir, self.nvme_root, self.deadline = args, workdir, nvme_root, deadline
        self.count = 0
        self.proc: subprocess.Popen | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, key: str, dim: str, micro: int, seq: int) -> Trial | None:
        """One trial; None when the total budget ran out before it could finish."""
        timeout = min(self.args.trial_timeout, self.left())
        if timeout < self.args.min_trial_s:
            return None
        self.count += 1
        label = f"{self.count:03d}-{key}-{dim}-b{micro}-s{seq}"
        side, _, policy = key.partition("-")
        hbm = int(self.args.hbm_gib * GiB)
        config = checkpointing_json(micro) if side == "ds" else tierstack_json(policy, micro, hbm)
        nvme_dir = self.nvme_root / label
        nvme_dir.mkdir(parents=True)
        spec = {"side": side, "config": config, "model": self.args.model, "seq": seq, "micro": micro,
                "steps": self.args.steps, "device": self.args.device, "nvme_dir": str(nvme_dir),
                "port": 29500 + (os.getpid() + self.count) % 2000, "hbm": hbm,
                "result": str(self.workdir / f"{label}.result")}
        (self.workdir / f"{label}.json").write_text(json.dumps(spec))
        start = time.monotonic()
        try:
            outcome, host_peak = self._wait(label, timeout)
        finally:
            shutil.rmtree(nvme_dir, ignore_errors=True)
            _reclaim_shm()
        wall = time.monotonic() - start
        if outcome is None and timeout < self.args.trial_timeout:
            return None  # cut short by the total budget: says nothing about fitting
        if outcome is None:
            outcome = {"fits": False, "reason": f"timeout after {timeout:.0f} s"}
        if not outcome["fits"] and not outcome["reason"]:
            outcome["reason"] = "child died: " + self._log_tail(label)
        trial = Trial(key, dim, micro, seq, outcome["fits"], outcome.get("reason", ""),
                      wall_s=round(wall, 1), host_peak=host_peak,
                      gpu_peak=outcome.get("gpu_peak", 0), placement=outcome.get("placement"),
                      phases=outcome.get("phases", []))
        if trial.fits:
            trial.step_s = [round(s, 4) for s in outcome["step_s"]]
            later = sorted(outcome["step_s"][self.args.warmup:] or outcome["step_s"])
            trial.tokens_per_s = round(micro * seq / later[len(later) // 2], 1)
        print(json.dumps(asdict(trial)), flush=True)
        return trial

    def _wait(self, label: str, timeout: float) -> tuple[dict | None, int]:
        """The child's result (None: none within `timeout`) and its host footprint peak."""
        result = self.workdir / f"{label}.result"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
               str(self.workdir / f"{label}.json")]
        with open(self.workdir / f"{label}.log", "w") as log:
            used_before = host_used_bytes()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        end, written, exited = time.monotonic() + timeout, None, False
        try:
            with Sampler(self.proc.pid, used_before=used_before) as sampler:
                while not exited and time.monotonic() < end:
                    if written is None and result.exists():
                        written = time.monotonic()
                    if written is not None and time.monotonic() - written > EXIT_GRACE_S:
                        break  # the result is in; a slow shutdown is not the trial's
                    time.sleep(0.5)
                    exited = self.proc.poll() is not None
        finally:
            self.kill()
        if result.exists():
            return json.loads(result.read_text()), sampler.peak
        # No result: a child that exited died (its log's tail says how), else it timed out.
        return ({"fits": False, "reason": ""} if exited else None), sampler.peak

    def _log_tail(self, label: str) -> str:
        text = (self.workdir / f"{label}.log").read_text(errors="replace")
        return f"rc {self.proc.returncode if self.proc else '?'}: " + text[-400:]

    def kill(self) -> None:
        """End the running child and every process it started (its daemons) if alive."""
        if self.proc is None:
            return
        kill_tree(self.proc.pid)
        try:  # and what is left of its group (a process whose parent died before)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _reclaim_shm() -> None:
    """CPU pool arenas and client lock files whose owner is gone (killed with its trial):
    only those, by the tier manager's own flock checks, never another live run's."""
    from tierstack.services.tier_manager.cpu_pool import reclaim_stale_arenas
    from tierstack.services.tier_manager.sessions import reclaim_stale_sessions

    reclaim_stale_arenas(Path("/dev/shm"))
    reclaim_stale_sessions(Path("/dev/shm"))


def searches(args) -> list[Search]:
    keys = [k for k in (["ds"] if "ds" in args.sides else [])
            + ([f"ts-{p}" for p in args.policies] if "ts" in args.sides else [])]
    out = []
    for key in keys:
        out.append(Search(key, "seq", args.seq_start, args.seq_step,
                          args.max_seq // args.seq_step * args.seq_step))
        out.append(Search(key, "batch", args.batch_start, 1, args.max_batch))
    return out


def run_searches(runner: TrialRunner, todo: list[Search], trials: list[Trial]) -> None:
    """One trial per search in turn until every search is done or the time is spent."""
    active = list(todo)
    while active:
        for search in list(active):
            size = search.next_size()
            if size is None:
                active.remove(search)
                continue
            micro, seq = (1, size) if search.dim == "seq" else (size, runner.args.seq)
            trial = runner.run(search.key, search.dim, micro, seq)
            if trial is None:
                for s in active:
                    s.out_of_time = s.next_size() is not None
                return
            trials.append(trial)
            search.record(size, trial.fits)


def at_deepspeed_max(runner: TrialRunner, done: list[Search], trials: list[Trial]) -> None:
    """Time left: each tierstack policy that fits DeepSpeed's largest size and has no
    trial there runs one, so tokens/s compare at one size."""
    ds = {s.dim: s.lo for s in done if s.key == "ds" and s.lo}
    for search in done:
        size = ds.get(search.dim)
        if search.key == "ds" or not size or search.lo < size:
            continue
        micro, seq = (1, size) if search.dim == "seq" else (size, runner.args.seq)
        if any(t.key == search.key and t.micro == micro and t.seq == seq for t in trials):
            continue
        trial = runner.run(search.key, f"{search.dim}-at-ds-max", micro, seq)
        if trial is None:
            return
        trials.append(trial)


def _tokens(trials: list[Trial], key: str, micro: int, seq: int) -> float | None:
    hits = [t.tokens_per_s for t in trials if t.key == key and t.micro == micro
            and t.seq == seq and t.fits]
    return max(hits) if hits else None


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summary(args, done: list[Search], trials: list[Trial], elapsed: float) -> dict:
    """The final JSON: per side/policy maxima and tokens/s there, tierstack's best over
    DeepSpeed's, tokens/s at DeepSpeed's largest sizes, the config and every trial."""
    results: dict[str, dict] = {}
    for s in done:
        entry = results.setdefault(s.key, {})
        micro, seq = (1, s.lo) if s.dim == "seq" else (s.lo, args.seq)
        entry[f"max_{s.dim}"] = s.lo or None
        entry[f"max_{s.dim}_status"] = s.status()
        entry[f"tokens_per_s_at_max_{s.dim}"] = _tokens(trials, s.key, micro, seq) if s.lo else None
    out: dict = {"config": {k: v for k, v in vars(args).items() if k != "child"},
                 "results": results}
    ds = results.get("ds", {})
    ts = {k: v for k, v in results.items() if k.startswith("ts-")}
    at_ds: dict = {}
    for dim in ("seq", "batch"):
        best = max((k for k in ts if ts[k].get(f"max_{dim}")), default=None,
                   key=lambda k: ts[k][f"max_{dim}"])
        out[f"best_policy_{dim}"] = best and best[3:]
        out[f"max_{dim}_vs_deepspeed"] = _ratio(best and ts[best].get(f"max_{dim}"), ds.get(f"max_{dim}"))
        size = ds.get(f"max_{dim}")
        if size:
            micro, seq = (1, size) if dim == "seq" else (size, args.seq)
            theirs = ds.get(f"tokens_per_s_at_max_{dim}")
            ours = {k[3:]: _tokens(trials, k, micro, seq) for k in ts}
            fastest = max((v for v in ours.values() if v), default=None)
            at_ds[dim] = {"micro": micro, "seq": seq, "deepspeed": theirs, "tierstack": ours,
                          "ratio": _ratio(fastest, theirs)}
    out["tokens_per_s_vs_deepspeed_at_its_max"] = {d: v["ratio"] for d, v in at_ds.items()}
    out["at_deepspeed_max"] = at_ds
    out["lower_bounds"] = any(s.out_of_time for s in done)
    out["elapsed_s"] = round(elapsed, 1)
    out["trials"] = [asdict(t) for t in trials]
    return out


QUICK = {"policies": "cpu,auto", "seq_step": 512, "seq_start": 2048, "trial_timeout": 180}


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--hbm-gib", type=float, default=16.0, help="the HBM budget of both sides")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length of the batch search")
    parser.add_argument("--sides", default="ds,ts", help="ds, ts or both")
    parser.add_argument("--policies", default=",".join(POLICIES), help="tierstack policies to search")
    parser.add_argument("--max-seq", type=int, default=65536)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--seq-step", type=int, default=256, help="sequence lengths are multiples of this")
    parser.add_argument("--seq-start", type=int, default=1024)
    parser.add_argument("--batch-start", type=int, default=1,
                        help="first micro-batch of the batch search (then doubling, bisection)")
    parser.add_argument("--steps", type=int, default=3, help="steps per trial")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps left out of tokens/s: tierstack's first optimizer step (it "
                             "makes the moments) runs behind its second step")
    parser.add_argument("--budget-s", type=float, default=540, help="total seconds for every trial")
    parser.add_argument("--trial-timeout", type=float, default=300)
    parser.add_argument("--min-trial-s", type=float, default=15,
                        help="no trial starts with less time left than this")
    parser.add_argument("--quick", action="store_true",
                        help="policies cpu,auto, sequence step 512 from 2048, trial timeout 180 s "
                             "(flags given explicitly win)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-actbench")
    parser.add_argument("--out", help="also write the final JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for name, value in QUICK.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    args.sides = [s for s in args.sides.split(",") if s]
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(args.policies) - set(POLICIES)) + sorted(set(args.sides) - {"ds", "ts"})
    if unknown:
        parser.error(f"unknown --policies/--sides {unknown}; policies are "
                     f"{', '.join(POLICIES)}, sides ds, ts")
    if "ds" in args.sides and not args.device.startswith("cuda"):
        parser.error("DeepSpeed needs a GPU here; use --sides ts with --device cpu")
    if args.seq_start % args.seq_step:
        parser.error("--seq-start must be a multiple of --seq-step")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child)
    # A SIGTERM (a device session's time running out) unwinds like Ctrl-C: the finally
    # below kills the running child and removes every directory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    made_nvme_dir = not Path(args.nvme_dir).exists()
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tierstack-actbench-"))
    nvme_root = Path(tempfile.mkdtemp(prefix="run-", dir=args.nvme_dir))
    start = time.monotonic()
    runner = TrialRunner(args, workdir, nvme_root, start + args.budget_s)
    todo, trials = searches(args), []
    try:
        run_searches(runner, todo, trials)
        at_deepspeed_max(runner, todo, trials)
    finally:
        runner.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(nvme_root, ignore_errors=True)
        if made_nvme_dir and not any(Path(args.nvme_dir).iterdir()):
            Path(args.nvme_dir).rmdir()
        _reclaim_shm()
    emit(summary(args, todo, trials, time.monotonic() - start), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
