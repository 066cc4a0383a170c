"""tierstack against MegaTrain on one GPU, side by side: one Qwen2, tokens per step, AdamW.

Why: MegaTrain (github DLYuanGod/MegaTrain, April 2026: layers streamed from host memory,
DeepSpeed's CPUAdam) is the system to beat on one GPU (issue 36, item 1). This bench runs
its own `examples/sft/train.py` and tierstack on the same model, the same tokens per
optimizer step and the same AdamW, each in a fresh process sampled from outside, and
reports per side tokens/s, TFLOPS at 6·N, the host footprint counted physically, the GPU
peak and the optimizer's arithmetic.

The model: a Qwen2ForCausalLM built from a transformers config, never downloaded (--model
7b: the Qwen2.5-7B shape, 7.62e9 parameters, untied; 1.5b: Qwen2.5-1.5B's, tied; tiny: a
CPU smoke test), bf16, sdpa, the same seed-0 weights and the same random token rows on
both sides (bench/vs_deepspeed.py's `_batches`): --rows rows of --seq tokens per optimizer
step (default 232 x 1024 = 237,568). AdamW at MegaTrain's own settings (examples/sft/
configs/qwen_7b_1gpu.yaml: lr 1e-5, betas 0.9/0.999, eps 1e-8, weight decay 0.01) and
gradient clipping 1.0 on both sides.

MegaTrain's side: its train.py runs unchanged (runpy, as `python train.py --config X`;
the run reports its git blob id) from the checkout at --megatrain-src, in a launcher (this
file, `--child mt`) that first installs these wrappers, each for a reason:
- AutoTokenizer / AutoConfig.from_pretrained: a stand-in tokenizer and this bench's
  config (no hub); AutoModelForCausalLM.from_pretrained builds the model from it (bf16 on
  the CPU, the attention train.py asks for), so both sides train the same weights;
- infinity's ChatDataset: the random rows (attention mask all ones, labels = the tokens:
  train.py's loss shifts them itself);
- no padding mask: CPUMasterModel hands every decoder layer the 2-D [B, T] mask, which
  sdpa refuses (flash-attn takes it, and is not on the GPU machine); the rows have no
  padding, so the layers get None: causal attention, what flash-attn would compute;
- timing (below), a sample of the weights each step changed, and the model and optimizer
  kept for the arithmetic check.
Its YAML is its own qwen_7b_1gpu.yaml with the model's name, sdpa, the dataset, seq, batch,
accumulation and step count as this bench says (`megatrain_yaml`); the rest stays
(checkpoint_interval 4, num_grad_slabs 12, 4 loader workers, CPUAdam). It trains
--mt-micro-batch rows per forward_and_backward (default --rows: one call per optimizer
step, as its YAML does), gradient_accumulation_steps = rows / that.
Nothing of MegaTrain is compiled: train.py's imports (infinity/__init__ on down) load
neither infinity/cuda_pipeline nor csrc's infinity_memory_ops (`extensions_loaded` in the
run says so; the committed build/ folders are aarch64 anyway). DeepSpeed compiles its
CPUAdam itself when train.py makes one (about a minute, cached in ~/.cache/torch_extensions
while the machine stays up), so deepspeed must be importable (deploy/device_env.sh puts
the carried wheel on the path): without it train.py would fall back to torch AdamW over
bf16 weights with bf16 moments, not MegaTrain as configured, so the launcher refuses.

How steps are timed. train.py times its own steps: perf_counter before forward_and_backward
(which ends with torch.cuda.synchronize) and after optimizer.step() and
_sync_params_to_gpu() (whose copies to the GPU are queued, not waited for); it logs Time,
Tokens/s and TFLOPS per micro-batch, with log timestamps of 1 s resolution. So both sides
are timed alike from outside instead: tierstack's by worker/engine/training_loop.py's run_steps (the
device synchronised before and after each step), MegaTrain's by the launcher, from the
start of a step's first forward_and_backward to the end of its _sync_params_to_gpu, after
torch.cuda.synchronize (the queued copies count). MegaTrain's CPUAdam runs inside that
span, so nothing of its step is left after its last one; tierstack's last step's block
updates run behind it, and the time they take past its end (run_tierstack's
`last_step_updates`) is added to the last step: the final optimizer drain counted.
tokens/s = tokens per step / the median of the settled steps (after --warmup: 5 by
default); train.py's own Tokens/s are reported beside as `own_tokens_per_s`.

The arithmetic (`exact_adamw`, read from the live objects after the first step).
MegaTrain's CPUAdam steps the bf16 weights themselves: train.py loads the model with
torch_dtype bf16 and CPUMasterModel keeps those tensors as its masters (`cpu_layers =
[layer.cpu() ...]`: no fp32 copy, whatever its docstring says); DeepSpeedCPUAdam keeps
fp32 moments (deepspeed/ops/adam/cpu_adam.py: state_dtype float with fp32_optimizer_states)
and computes in fp32, then stores the new weight into the bf16 parameter
(deepspeed/ops/csrc/adam/cpu_adam_impl.cpp, Step_1: `_params[k] = param`, float to
c10::BFloat16; the AVX path likewise), so an update below half a bf16 step of the weight is
lost (`weights_changed_share`: per step, the share of layer 0's sampled weights that
moved). tierstack at precision bf16 keeps fp32 masters of every parameter (worker/
engine.py `_keep_the_rest`; worker/engine/tiered_adamw.py refuses bf16 blocks without them) and
rounds to bf16 only on the way to the device.

Host footprint: bench/footprint.py's Sampler on each side's process tree (PSS summed over
every process: MegaTrain's loader workers, tierstack's embedded daemon; pinned and shared
pages once), the MemTotal - MemAvailable delta as the cross-check, RSS - RssShmem beside.
GPU peak: max_memory_allocated over the training steps (train.py resets it before its
loop, run_tierstack before its steps).

tierstack's side is bench/vs_deepspeed.py's `run_tierstack` (embedded scheduler and tier
manager; no placement and no budgets given, so the planner places under the machine's),
given this bench's model for its LLaMA, --micro-batch rows per micro-batch accumulated to
--rows.

Output: one JSON line per run, then the summary (also to --out, rewritten after every run
so that a call cut short keeps what finished): `tokens_per_s_vs_megatrain_<model>` and
`host_footprint_vs_megatrain_<model>` (tierstack / MegaTrain), `exact_adamw` (tierstack's)
and `megatrain_exact_adamw`, each side's medians (`mt.*`, `ts.*`) and every run.

On the GPU machine, MegaTrain's source exported to .megatrain/ (about 0.5 MB):
  git -C MEGATRAIN_CHECKOUT archive HEAD infinity examples/sft LICENSE | \
      tar -x -C .megatrain --exclude=__pycache__ --exclude=build --exclude='*.egg-info'
  source deploy/device_env.sh && python3 bench/vs_megatrain.py --model 7b \
      --out bench/results/vs_megatrain_7b.json
Under a cap on a command's time, one side per command, the second joining the first's runs:
  ... --sides mt --out bench/results/vs_megatrain_7b.json
  ... --sides ts --previous bench/results/vs_megatrain_7b.json --out bench/results/vs_megatrain_7b.json
A GPU smaller than an H200 takes MegaTrain's 232-row batch in parts: --mt-micro-batch 116.
Anywhere tierstack runs:
  python3 bench/vs_megatrain.py --model tiny --sides ts --device cpu --seq 64 --rows 8 --micro-batch 4
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import hashlib
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_deepspeed  # noqa: E402
from footprint import Sampler, host_used_bytes  # noqa: E402
from tierstack.process_tree import kill_tree  # noqa: E402
from tierstack.worker.node.run_directory import run_directory  # noqa: E402

# Qwen2 shapes (transformers' Qwen2Config): rope theta 1e6 and RMS eps 1e-6 for all.
MODELS = {
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512, tie_word_embeddings=False),
}
ROPE_THETA, RMS_EPS = 1e6, 1e-6
# MegaTrain's examples/sft/configs/qwen_7b_1gpu.yaml, given to both sides.
ADAMW = {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
GRADIENT_CLIPPING = 1.0
MEGATRAIN_TRAIN = "examples/sft/train.py"
MEGATRAIN_YAML = "examples/sft/configs/qwen_7b_1gpu.yaml"
STAND_IN = "tierstack-bench/qwen2.5-{model}-from-config"  # the model name train.py is given
EXTENSIONS = ("cuda_pipeline", "infinity_memory_ops")  # MegaTrain's compiled modules
OWN_TOKENS = re.compile(r"Tokens/s ([0-9.]+)")  # train.py's per-step log line


# ---- the model, the same on both sides ---------------------------------------------------


def qwen_config(model: str):
    """The transformers config of a --model shape."""
    from transformers import Qwen2Config

    return Qwen2Config(**MODELS[model], rope_theta=ROPE_THETA, rms_norm_eps=RMS_EPS,
                       max_position_embeddings=32768)


@contextlib.contextmanager
def hugging_face_init_only():
    """torch's own init of each Linear and Embedding skipped while a model is built: Hugging
    Face's init (normal, std initializer_range; biases 0) overwrites every one of them, and
    at 7B each pass costs the CPU a minute or more (uniform_, then normal_)."""
    import torch

    classes = (torch.nn.Linear, torch.nn.Embedding)
    saved = [cls.reset_parameters for cls in classes]
    for cls in classes:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, reset in zip(classes, saved):
            cls.reset_parameters = reset


def build_model(model: str, dtype=None, attn: str = "sdpa"):
    """The model, made from its config in `dtype` (default bf16) on the CPU, seed 0."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with hugging_face_init_only():
        built = AutoModelForCausalLM.from_config(qwen_config(model), dtype=dtype or torch.bfloat16,
                                                 attn_implementation=attn)
    rope = getattr(built.config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(built.config, "rope_theta", None))
    if theta != ROPE_THETA or built.config._attn_implementation != attn:
        raise RuntimeError(f"transformers built rope theta {theta}, attention "
                           f"{built.config._attn_implementation!r}; this bench asked for "
                           f"{ROPE_THETA}, {attn!r}: check qwen_config against this transformers")
    for name, param in built.named_parameters():  # a skipped init leaves zeros (fresh pages)
        if param.dim() >= 2 and not param.detach().flatten()[:4096].float().std() > 0:
            raise RuntimeError(f"transformers left {name} uninitialised: build_model skips "
                               f"torch's init, counting on Hugging Face's to cover every weight")
    return built


def parameter_count(params) -> int:
    """Elements of distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def dtypes(tensors) -> list[str]:
    """The dtypes among `tensors`, by name ("bfloat16")."""
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def random_rows(model: str, rows: int, seq: int, steps: int):
    """Each step's token rows, as bench/vs_deepspeed.py's run_tierstack makes them."""
    return vs_deepspeed._batches(MODELS[model]["vocab_size"], rows, seq, steps)


# ---- MegaTrain's side (the child process: its train.py under the wrappers) ---------------


def megatrain_yaml(template: dict, spec: dict) -> dict:
    """MegaTrain's own YAML with what this bench sets: the stand-in model and data, sdpa,
    the batch and step count, and the AdamW settings both sides share."""
    config = copy.deepcopy(template)
    accumulation = spec["rows"] // spec["mt_micro_batch"]
    config["model"].update(name=STAND_IN.format(model=spec["model"]), dtype="bfloat16",
                           attn_implementation="sdpa")
    config["dataset"].update(name="random-rows", max_seq_len=spec["seq"])
    config["dataset"].pop("path", None)
    config["training"].update(batch_size=spec["mt_micro_batch"],
                              gradient_accumulation_steps=accumulation,
                              num_steps=spec["steps"] * accumulation,
                              learning_rate=ADAMW["lr"], weight_decay=ADAMW["weight_decay"],
                              max_grad_norm=GRADIENT_CLIPPING)
    config["optimizer"].update(type="deepspeed_adam", beta1=ADAMW["betas"][0],
                               beta2=ADAMW["betas"][1], eps=ADAMW["eps"])
    return config


class StandInTokenizer:
    """What train.py asks of a tokenizer before handing it to the dataset: a pad token."""

    pad_token = eos_token = "<|endoftext|>"


class RandomRows:
    """ChatDataset's place: every step's rows in order (the loader does not shuffle), no
    padding (attention mask all ones), labels = the tokens (train.py's loss shifts them)."""

    def __init__(self, ids) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        import torch

        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.ids[i]}


class Seen:
    """What the wrappers saw: step boundaries (perf_counter), losses, the live objects."""

    def __init__(self) -> None:
        self.starts: list[float] = []  # each forward_and_backward call's start
        self.ends: list[float] = []  # each optimizer step's end, the device synchronised
        self.losses: list[float] = []  # each forward_and_backward's loss
        self.changed: list[float] = []  # each step's share of sampled weights it changed
        self.model = None
        self.optimizer = None
        self.arithmetic: dict | None = None  # read after the first optimizer step


def _only(name: str, expected: str) -> None:
    if name != expected:
        raise RuntimeError(f"the bench's stand-ins build {expected!r} only; train.py asked for "
                           f"{name!r}: check the YAML's model.name")


def cpu_adam():
    """DeepSpeed's CPUAdam class, which MegaTrain's YAML trains with."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        raise SystemExit(
            f"deepspeed is not importable ({e}): MegaTrain's YAML trains with DeepSpeed's "
            f"CPUAdam, and without it train.py falls back to torch AdamW with bf16 moments. "
            f"Put deepspeed on PYTHONPATH (source deploy/device_env.sh installs the carried "
            f".whl/deepspeed-*.whl)") from None
    return DeepSpeedCPUAdam


def install_stand_ins(spec: dict) -> list[str]:
    """What train.py loads from the hub and disk, made here instead; what each does."""
    import torch
    import transformers

    import infinity
    name = STAND_IN.format(model=spec["model"])

    def tokenizer(path, *a, **kw):
        _only(path, name)
        return StandInTokenizer()

    def config(path, *a, **kw):
        _only(path, name)
        return qwen_config(spec["model"])

    def model(path, *a, torch_dtype=None, dtype=None, attn_implementation="sdpa", **kw):
        _only(path, name)
        return build_model(spec["model"], dtype or torch_dtype, attn_implementation)

    transformers.AutoTokenizer.from_pretrained = staticmethod(tokenizer)
    transformers.AutoConfig.from_pretrained = staticmethod(config)
    transformers.AutoModelForCausalLM.from_pretrained = staticmethod(model)
    ids = torch.cat(random_rows(spec["model"], spec["rows"], spec["seq"], spec["steps"]))
    infinity.ChatDataset = lambda tokenizer, max_seq_len, **kw: RandomRows(ids)
    return ["AutoTokenizer.from_pretrained: a stand-in with a pad token",
            "AutoConfig.from_pretrained: the bench's Qwen2Config",
            "AutoModelForCausalLM.from_pretrained: the model built from that config",
            "infinity.ChatDataset: random rows, attention mask all ones, labels = tokens"]


def install_probes(seen: Seen, optimizer_class) -> list[str]:
    """Wrap CPUMasterModel's and the optimizer's methods: the mask dropped, steps timed,
    the live objects and the arithmetic recorded in `seen`; what each does."""
    import torch

    from infinity.model.cpu_master import CPUMasterModel

    def wrap(cls, attr: str, make) -> None:
        setattr(cls, attr, make(getattr(cls, attr)))

    def recording(field: str):
        def make(init):
            def __init__(self, *a, **kw):
                init(self, *a, **kw)
                setattr(seen, field, self)
            return __init__
        return make

    def without_mask(build):
        def _build_layer_kwargs(self, mask, *a, **kw):
            kwargs = build(self, mask, *a, **kw)
            kwargs["attention_mask"] = None  # rows without padding: causal attention
            return kwargs
        return _build_layer_kwargs

    def timed(forward_and_backward):
        def timed_forward_and_backward(self, *a, **kw):
            seen.starts.append(time.perf_counter())
            out = forward_and_backward(self, *a, **kw)
            seen.losses.append(float(out[0]))
            return out
        return timed_forward_and_backward

    def synced(sync):
        def _sync_params_to_gpu(self, *a, **kw):
            seen.changed.append(changed_share(self))  # before the sync refreshes its copy
            sync(self, *a, **kw)
            torch.cuda.synchronize()  # its queued copies are the step's too
            seen.ends.append(time.perf_counter())
            if seen.arithmetic is None:  # gradients and moments exist now
                seen.arithmetic = megatrain_arithmetic(self, seen.optimizer)
        return _sync_params_to_gpu

    wrap(CPUMasterModel, "__init__", recording("model"))
    wrap(optimizer_class, "__init__", recording("optimizer"))
    wrap(CPUMasterModel, "_build_layer_kwargs", without_mask)
    wrap(CPUMasterModel, "forward_and_backward", timed)
    wrap(CPUMasterModel, "_sync_params_to_gpu", synced)
    return ["CPUMasterModel._build_layer_kwargs: attention_mask None (causal sdpa)",
            "CPUMasterModel.forward_and_backward: start time and loss recorded",
            "CPUMasterModel._sync_params_to_gpu: changed weights sampled, then "
            "torch.cuda.synchronize and the end time recorded",
            f"CPUMasterModel / {optimizer_class.__name__} __init__: the instances recorded"]


def git_blob(path: Path) -> str:
    """The file's git blob id (as `git ls-tree` shows it): which train.py ran, unchanged."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def changed_share(model, layer: int = 0, sample: int = 1 << 18) -> float | None:
    """The share of layer `layer`'s weights the optimizer step just changed, over the first
    `sample` elements of each of its tensors: its pinned flat copy still holds the weights
    of the last step until _sync_params_to_gpu refreshes it (an update smaller than half a
    bf16 step of the weight leaves the weight as it was)."""
    if not model.layer_pinned_flats:  # multi-GPU mode keeps no such copy
        return None
    flat, offset, changed, compared = model.layer_pinned_flats[layer], 0, 0, 0
    for p in model.cpu_layers[layer].parameters():
        n = min(p.numel(), sample)
        changed += int((p.data.flatten()[:n] != flat[offset:offset + n]).sum())
        compared, offset = compared + n, offset + p.numel()
    return changed / compared


def megatrain_arithmetic(model, optimizer) -> dict:
    """What MegaTrain's optimizer steps: the dtypes of the weights it updates, of their
    gradients and of its moments; exact (fp32 masters) only if the weights are fp32."""
    import torch

    params = model.get_parameters()
    states = [optimizer.state[p] for p in params if p in optimizer.state]
    return {"optimizer": type(optimizer).__name__,
            "fp32_optimizer_states": getattr(optimizer, "fp32_optimizer_states", None),
            "weight_dtypes": dtypes(params),
            "grad_dtypes": dtypes(p.grad for p in params if p.grad is not None),
            "moment_dtypes": dtypes(s["exp_avg"] for s in states if "exp_avg" in s),
            "fp32_masters": all(p.dtype == torch.float32 for p in params)}


def megatrain_steps(seen: Seen, accumulation: int) -> tuple[list[float], list[float]]:
    """(seconds, mean loss) of each optimizer step: its first micro-batch's start to its end."""
    starts = seen.starts[::accumulation]
    if len(seen.ends) != len(starts):
        raise RuntimeError(f"train.py made {len(seen.ends)} optimizer steps for "
                           f"{len(seen.starts)} forward_and_backward calls at accumulation "
                           f"{accumulation}; expected one per {accumulation} calls")
    losses = [statistics.mean(seen.losses[i:i + accumulation])
              for i in range(0, len(seen.losses), accumulation)]
    return [end - start for start, end in zip(starts, seen.ends)], losses


def run_megatrain(spec: dict) -> dict:
    """MegaTrain's train.py, unchanged, under the wrappers; what it did, measured."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("MegaTrain's CPUMasterModel needs a CUDA GPU (pinned buffers, streams, "
                         "events); run --sides mt on the GPU machine, --sides ts runs anywhere")
    src = Path(spec["megatrain_src"])
    train_py = src / MEGATRAIN_TRAIN
    sys.path.insert(0, str(src))  # train.py imports its `infinity` package from the checkout
    # train.py sets this at its import, before it imports deepspeed: deepspeed is imported
    # here first (to be wrapped), so CUDA is configured as train.py would have it by then.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    optimizer_class, seen = cpu_adam(), Seen()  # refused first if deepspeed is missing
    wrappers = install_stand_ins(spec) + install_probes(seen, optimizer_class)
    argv, sys.argv = sys.argv, [str(train_py), "--config", spec["yaml"]]
    try:
        runpy.run_path(str(train_py), run_name="__main__")
    finally:
        sys.argv = argv
    if seen.optimizer is None or seen.arithmetic is None:
        raise RuntimeError("train.py ran without a DeepSpeedCPUAdam step: its log says which "
                           "optimizer it chose")
    accumulation = spec["rows"] // spec["mt_micro_batch"]
    step_s, losses = megatrain_steps(seen, accumulation)
    arithmetic = {**seen.arithmetic, "weights_changed_share": seen.changed}
    return {"step_s": step_s, "losses": losses, "drain_s": 0.0,  # CPUAdam runs inside the step
            "gpu_peak": torch.cuda.max_memory_allocated(0),
            "gpu_reserved_peak": torch.cuda.max_memory_reserved(0),
            "params": parameter_count(seen.model.get_parameters()),
            "tokens_per_step": spec["rows"] * spec["seq"], "accumulation": accumulation,
            "exact_adamw": arithmetic["fp32_masters"], "arithmetic": arithmetic,
            "megatrain": {"train_py_blob": git_blob(train_py),
                          "cpu_master_blob": git_blob(src / "infinity/model/cpu_master.py"),
                          "extensions_loaded": [m for m in EXTENSIONS if m in sys.modules],
                          "wrappers": wrappers, "yaml": spec["megatrain_yaml"]}}


# ---- tierstack's side (the child process: vs_deepspeed's run_tierstack) -----------------


def tierstack_config(micro_batch: int, rows: int) -> dict:
    """tierstack's config: no placement and no budgets, so the planner places under the
    machine's budgets; micro-batches accumulated to `rows`; MegaTrain's AdamW."""
    return {"train": {"micro_batch_size": micro_batch,
                      "gradient_accumulation_steps": rows // micro_batch,
                      "precision": "bf16", "gradient_clipping": GRADIENT_CLIPPING,
                      "optimizer": {"type": "adamw", **ADAMW}}}


def tierstack_arithmetic(engine) -> dict:
    """What tierstack's optimizers step: fp32 masters of the device's parameters (and of
    the resident blocks), and of the offloaded blocks in the tier manager."""
    import torch

    masters = engine.persistent_masters
    blocks = engine.block_optimizer.masters or engine.precision == "fp32"
    return {"optimizer": "AdamW (torch fused on the device, the tier manager's for offloaded blocks)",
            "weight_dtypes": dtypes(engine.persistent), "master_dtypes": dtypes(masters),
            "offloaded_block_masters": blocks, "weights_from_masters": engine.from_masters,
            "fp32_masters": blocks and all(m.dtype == torch.float32 for m in masters)}


def last_step_drain(result: dict) -> float:
    """Seconds the last step's block updates ran past its end (0 when none did)."""
    ends = [end for _, _, end in result.get("last_step_updates") or []]
    return max(0.0, max(ends, default=0.0) - result["step_s"][-1])


def run_tierstack_side(spec: dict) -> dict:
    """bench/vs_deepspeed.py's run_tierstack on this bench's model and rows.

    run_tierstack builds its model and rows by name with vs_deepspeed's `_model` (a LLaMA)
    and `MODELS`: here the name is this bench's own and `_model` builds the Qwen2; its
    `_time_phases` is wrapped to keep the engine for the arithmetic check."""
    name, seen = f"qwen2.5-{spec['model']}", {}

    def model(_name: str, _seq: int):
        built = build_model(spec["model"])
        seen["params"] = parameter_count(built.parameters())
        return built

    def time_phases(engine, store):
        seen["engine"] = engine
        return phases(engine, store)

    phases = vs_deepspeed._time_phases
    vs_deepspeed.MODELS = {**vs_deepspeed.MODELS, name: MODELS[spec["model"]]}
    vs_deepspeed._model = model
    vs_deepspeed._time_phases = time_phases
    args = argparse.Namespace(model=name, seq=spec["seq"], micro=spec["rows"], steps=spec["steps"],
                              device=spec["device"], nvme_dir=spec["nvme_dir"])
    result = vs_deepspeed.run_tierstack(args, spec["config"])
    if "params" not in seen or "engine" not in seen:
        raise RuntimeError("bench/vs_deepspeed.py's run_tierstack no longer builds its model with "
                           "_model or times phases with _time_phases: its ts side trained something "
                           "else; update run_tierstack_side to its new seams")
    arithmetic = tierstack_arithmetic(seen["engine"])
    result.update(drain_s=last_step_drain(result), params=seen["params"],
                  tokens_per_step=spec["rows"] * spec["seq"],
                  accumulation=spec["config"]["train"]["gradient_accumulation_steps"],
                  exact_adamw=arithmetic["fp32_masters"], arithmetic=arithmetic)
    return result


def child(side: str, spec_path: str) -> int:
    """One side's run in this process; its figures on stdout as `RESULT {json}`."""
    spec = json.loads(Path(spec_path).read_text())
    result = run_megatrain(spec) if side == "mt" else run_tierstack_side(spec)
    # run_tierstack's budgets carry a frozenset (Budgets.stated): a sorted list in JSON
    print("RESULT " + json.dumps(result, default=sorted), flush=True)
    return 0


# ---- the comparison (this process) -------------------------------------------------------


def settled_figures(result: dict, warmup: int) -> dict:
    """tokens/s over the settled steps (the last one with its drain), and TFLOPS at 6·N."""
    settled = list(result["step_s"][warmup:])
    settled[-1] += result["drain_s"]
    median = statistics.median(settled)
    tokens = result["tokens_per_step"]
    return {"settled_steps": len(settled), "step_median": median,
            "tokens_per_s": tokens / median,
            "tokens_per_s_settled_mean": tokens * len(settled) / sum(settled),
            "tflops": 6 * result["params"] * tokens / median / 1e12}


def launch(args, side: str, spec: dict, label: str, workdir: Path) -> dict:
    """One side's run in a fresh process, its tree sampled from outside; its RESULT with
    the footprint and the settled figures added."""
    spec_path = workdir / f"{label}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{label}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--spec", str(spec_path)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        used_before = host_used_bytes()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        with Sampler(proc.pid, interval=args.sample_interval, used_before=used_before) as sampler:
            try:
                out, _ = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)  # its loader workers too
                proc.communicate()
                raise RuntimeError(f"{label} ran past --timeout {args.timeout:.0f} s:\n"
                                   f"{log_path.read_text()[-2000:]}") from None
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result.update(label=label, side=side, wall_s=time.perf_counter() - start, warmup=args.warmup,
                  **sampler.figures("host"), **settled_figures(result, args.warmup))
    if side == "mt":
        result["own_tokens_per_s"] = own_tokens_per_s(log_path.read_text(),
                                                      args.warmup * result["accumulation"])
    print(json.dumps(result), flush=True)
    return result


def own_tokens_per_s(log: str, skip: int) -> float | None:
    """The median of train.py's own logged Tokens/s (one per micro-batch), the first
    `skip` left out as the warm-up steps are."""
    own = [float(x) for x in OWN_TOKENS.findall(log)]
    return statistics.median(own[skip:] or own) if own else None


def spec_of(args, side: str) -> dict:
    """What a side's child needs to know."""
    spec = {"model": args.model, "seq": args.seq, "rows": args.rows, "steps": args.steps}
    if side == "mt":
        spec.update(megatrain_src=str(args.megatrain_src), mt_micro_batch=args.mt_micro_batch,
                    yaml=str(args.megatrain_yaml_path), megatrain_yaml=args.megatrain_yaml)
    else:
        spec.update(device=args.device, nvme_dir=args.nvme_dir,
                    config=tierstack_config(args.micro_batch, args.rows))
    return spec


def write_megatrain_yaml(src: Path, spec: dict, path: Path) -> dict:
    """Its qwen_7b_1gpu.yaml with this bench's settings (megatrain_yaml), written to `path`."""
    import yaml

    for needed in (src / MEGATRAIN_TRAIN, src / MEGATRAIN_YAML):
        if not needed.is_file():
            raise SystemExit(
                f"--megatrain-src {src}: no {needed.relative_to(src)}. Export a MegaTrain checkout "
                f"there: git -C CHECKOUT archive HEAD infinity examples/sft LICENSE | tar -x -C {src}")
    config = megatrain_yaml(yaml.safe_load((src / MEGATRAIN_YAML).read_text()), spec)
    # PyYAML reads 1e-05 as a string: its own dump writes floats it reads back (1.0e-05)
    path.write_text(yaml.safe_dump(config))
    return config


SAME_RUN = ("model", "seq", "rows", "micro_batch", "mt_micro_batch")  # what --previous must match


def settings(values: dict) -> dict:
    """The settings of a call (its arguments) or of a summary that --previous compares."""
    return {k: values.get(k) for k in SAME_RUN}


def same_run(args, earlier: dict) -> bool:
    """Whether an earlier summary trained what this call trains."""
    return settings(earlier) == settings(vars(args))


def summarize(args, runs: list[dict], failures: dict) -> dict:
    """Each side's medians over its runs, the ratios (tierstack / MegaTrain), every run."""
    def med(side: str, figure: str):
        values = [r[figure] for r in runs if r["side"] == side and r.get(figure) is not None]
        return statistics.median(values) if values else None

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    summary = {"model": args.model, "seq": args.seq, "rows": args.rows,
               "micro_batch": args.micro_batch, "mt_micro_batch": args.mt_micro_batch,
               "tokens_per_step": args.rows * args.seq, "steps": args.steps, "warmup": args.warmup,
               "adamw": ADAMW, "gradient_clipping": GRADIENT_CLIPPING, "date": time.strftime("%Y-%m-%d"),
               "params": sorted({r["params"] for r in runs})}
    figures = ("tokens_per_s", "tokens_per_s_settled_mean", "tflops", "step_median", "drain_s",
               "host_peak", "host_used_delta_peak", "host_rss_minus_shmem_peak", "gpu_peak",
               "own_tokens_per_s", "predicted_step_s")
    for side in ("mt", "ts"):
        for figure in figures:
            value = med(side, figure)
            if value is not None:
                summary[f"{side}.{figure}"] = value
    m = args.model
    summary[f"tokens_per_s_vs_megatrain_{m}"] = ratio(med("ts", "tokens_per_s"), med("mt", "tokens_per_s"))
    summary[f"host_footprint_vs_megatrain_{m}"] = ratio(med("ts", "host_peak"), med("mt", "host_peak"))
    summary[f"host_used_delta_vs_megatrain_{m}"] = ratio(med("ts", "host_used_delta_peak"),
                                                         med("mt", "host_used_delta_peak"))
    summary[f"gpu_peak_vs_megatrain_{m}"] = ratio(med("ts", "gpu_peak"), med("mt", "gpu_peak"))
    for side, key in (("ts", "exact_adamw"), ("mt", "megatrain_exact_adamw")):
        exact = [r["exact_adamw"] for r in runs if r["side"] == side]
        summary[key] = all(exact) if exact else None
    summary["failures"] = failures
    summary["runs"] = runs
    return summary


def write(summary: dict, out: str | None) -> None:
    """The summary so far to `out` (none: nothing), without printing it."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary) + "\n")


def check(parser, args) -> None:
    """Refuse settings the two sides cannot train alike."""
    args.mt_micro_batch = args.mt_micro_batch or args.rows
    for flag, value in (("--micro-batch", args.micro_batch), ("--mt-micro-batch", args.mt_micro_batch)):
        if value < 1 or args.rows % value:
            parser.error(f"{flag} {value} does not divide --rows {args.rows}: both sides train "
                         f"--rows rows per optimizer step, in micro-batches of that many")
    if args.steps - args.warmup < 1:
        parser.error(f"--steps {args.steps} leaves no settled step after --warmup {args.warmup}")
    unknown = set(args.sides.split(",")) - {"mt", "ts"}
    if unknown:
        parser.error(f"--sides: {sorted(unknown)} unknown; give mt, ts or mt,ts")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="7b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=232, help="rows per optimizer step, both sides")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="tierstack's micro-batch (accumulated to --rows)")
    parser.add_argument("--mt-micro-batch", type=int, default=0,
                        help="MegaTrain's rows per forward_and_backward (default --rows: no accumulation)")
    parser.add_argument("--steps", type=int, default=7, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted")
    parser.add_argument("--sides", default="mt,ts", help="mt (MegaTrain), ts (tierstack) or both")
    parser.add_argument("--reps", type=int, default=1, help="runs of each side, interleaved")
    parser.add_argument("--megatrain-src", default=".megatrain", help="a MegaTrain checkout")
    parser.add_argument("--device", default="cuda", help="tierstack's device")
    parser.add_argument("--nvme-dir", default="/var/tmp/tierstack-vsmt")
    parser.add_argument("--timeout", type=float, default=3000, help="seconds per run")
    parser.add_argument("--sample-interval", type=float, default=0.1, help="footprint sampling, seconds")
    parser.add_argument("--previous", help="an earlier --out of the same settings: its runs join these")
    parser.add_argument("--out", help="also write the summary here (after every run)")
    parser.add_argument("--child", choices=("mt", "ts"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.spec)
    check(parser, args)
    sides = args.sides.split(",")
    runs: list[dict] = []
    if args.previous:
        earlier = json.loads(Path(args.previous).read_text())
        if not same_run(args, earlier):
            parser.error(f"--previous {args.previous} trained {settings(earlier)}, this call "
                         f"{settings(vars(args))}: give the same settings to both calls")
        runs = [r for r in earlier["runs"] if r["side"] not in sides]
    leave = contextlib.ExitStack()
    atexit.register(leave.close)
    args.workdir = leave.enter_context(tempfile.TemporaryDirectory(prefix="tierstack-vsmt-"))
    if "mt" in sides:
        args.megatrain_src = Path(args.megatrain_src).resolve()
        args.megatrain_yaml_path = Path(args.workdir) / "megatrain.yaml"
        args.megatrain_yaml = write_megatrain_yaml(args.megatrain_src, vars(args),
                                                   args.megatrain_yaml_path)
    if "ts" in sides:
        args.nvme_dir = leave.enter_context(run_directory(args.nvme_dir, setting="--nvme-dir"))
    failures: dict[str, str] = {}
    for rep in range(args.reps):
        for side in sides:
            label = f"{side}-{args.model}-{rep}"
            try:
                runs.append(launch(args, side, spec_of(args, side), label, Path(args.workdir)))
            except RuntimeError as e:  # reported; the other runs still go
                failures[label] = str(e)[-3000:]
                print(json.dumps({"label": label, "failed": failures[label]}), flush=True)
            write(summarize(args, runs, failures), args.out)
    vs_deepspeed.emit(summarize(args, runs, failures), args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
