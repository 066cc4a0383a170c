"""One rank of a partitioned training run: what every launcher runs.

`run_rank(env, spec)` joins the process group, finds (or starts) its node's tier manager,
trains the model of `spec` (the project's GPT, or a Hugging Face LLaMA built from a
config) with its blocks partitioned over the ranks and its slice of every global batch,
and returns per-step figures: the global loss, the step time, and the bytes this rank
moved through each tier. The Ray actors (`tierstack train --ranks N`),
the plain multiprocessing launcher and `torchrun` (the GPU machine has no Ray) all call
it, so every way of starting ranks trains the same way.
"""

from __future__ import annotations

import inspect
import itertools
import os
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from tierstack.checkpoint_layout import find
from tierstack.config import (ActivationConfig, BudgetsConfig, MiB, OptimizerConfig,
                              ParamOffloadConfig, TierManagerConfig, TierstackConfig, TrainConfig,
                              config_dict, load_config)
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine.block_views import is_parked
from tierstack.worker.engine.checkpoint import export_safetensors, load_checkpoint, save_tagged
from tierstack.worker.engine.offload_engine import OffloadEngine, materialize
from tierstack.worker.engine.training_loop import run_steps
from tierstack.worker.job import Job, JobSpec, SchedulerUse, open_job
from tierstack.worker.jobs.corpus import ByteBatches, stdlib_bytes
from tierstack.worker.jobs.gpt import GPTConfig, build_gpt
from tierstack.worker.node.distributed import RankEnv, init_process_group, rank_device


@dataclass
class PartitionedSpec:
    """What to train and where its state lives; the same on every rank."""

    gpt: GPTConfig = field(default_factory=GPTConfig)
    """The model trained unless `hf_llama` is set; its seq_len is every row's length either way."""
    hf_llama: dict | None = None
    """transformers.LlamaConfig keyword arguments: train a LlamaForCausalLM built from them
    instead of the GPT (blocks at model.layers, created one at a time by Hugging Face's own
    init; head untied from the embedding and torch's SDPA attention unless given here). The
    loss is the engine's: cross-entropy of the logits against the batch's targets, the next
    tokens (what the model computes from labels). Rows are gpt.seq_len tokens drawn from
    the LLaMA's vocabulary."""
    steps: int = 10
    global_batch: int = 8
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: str = "fp32"
    gradient_clipping: float = 0.0
    """train.gradient_clipping: the global gradient's norm is clipped to this (0: not clipped)."""
    prefetch_depth: int = 2
    device_budget_layers: int = 3
    device_budget: int = 0        # bytes; 0: device_budget_layers layers' worth
    device: str | None = None
    job: str = ""
    data: str = "stdlib"          # "stdlib" (the byte corpus) or "random" tokens
    tier_manager: str | None = None
    """The node's tier-manager address; None: each rank finds its node's, or starts its own
    embedded one (its NVMe pool under the config's root, in a directory per rank)."""
    scheduler: str = ""
    """The scheduler rank 0 reports the job's trace to and takes plans from, which every
    rank follows ('' for none); the ranks' tier managers are registered with it."""
    embedded: dict | None = None
    """tier_manager config (as config_dict gives) for the embedded daemons; paths get a per-rank suffix."""
    collect_state: bool = False   # gather the trained weights into the result (tests)
    checkpoint_dir: str = ""
    """Where the whole training state is saved at the end: a `global_step<N>` tag and `latest`,
    the newest kept (worker/engine/checkpoint.py's format: rank 0 writes, every rank must see
    the directory)."""
    checkpoint_every: int = 0     # steps between checkpoints (0: only at the end)
    resume: bool = False          # continue from checkpoint_dir's state up to `steps`
    export: str = ""              # a directory for safetensors weights (from_pretrained)
    cpu_threads: int = 0          # torch intra-op threads per rank on the CPU; 0: torch's default
    activation_policy: str = "auto"
    """train.activations.policy of the ranks' engines ("auto" here, with no HBM budget given:
    every block recomputed from its input on the device)."""
    partition_activations: bool = False
    """train.activations.partition: spread the inputs sent to the tier managers ("cpu",
    "nvme") over the ranks' nodes (worker/engine/partitioned_stash.py)."""
    time_phases: bool = False
    """Time each step's phases (StepFigures' forward_s ... tier_wait_s; the engine's
    time_phases): on CUDA a few timing events per collective, so off unless asked."""

    def train_config(self) -> TrainConfig:
        """How each rank's engine trains, as the train section says it."""
        return TrainConfig(optimizer=self.optimizer, precision=self.precision,
                           gradient_clipping=self.gradient_clipping,
                           params=ParamOffloadConfig(buffer_count=self.prefetch_depth + 1),
                           activations=ActivationConfig(self.activation_policy,
                                                        self.partition_activations))


@dataclass
class StepFigures:
    loss: float
    seconds: float
    cpu_pool_read: int   # bytes this rank read from its tier manager's CPU pool
    cpu_pool_written: int
    nvme_read: int       # bytes its tier manager read from NVMe (its own daemon only)
    nvme_written: int    # bytes its tier manager wrote to NVMe
    gathered: int        # bytes received from the other ranks by all-gathers
    exchanged: int = 0   # stashed-input bytes sent to the other ranks (partitioned activations)
    # Where the step's time went (seconds, this rank): ensure_layer waiting for its shards'
    # loads and all-gathers, the daemon's AdamW kernel over this rank's shards, and the
    # daemon waiting for their state to be read (may overlap each other and compute).
    stalled_s: float = 0.0
    daemon_adamw_s: float = 0.0
    daemon_state_reads_s: float = 0.0
    # With spec.time_phases (worker/store/step_phases.py), else 0: the main thread's forward,
    # backward and optimizer call (one after the other, so they add up to at most the
    # step), the communication thread's collectives by kind (one at a time: each kind,
    # and all of them, at most the step; they overlap the forward and backward) and its
    # waits for this rank's shards to come from its tiers.
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    all_gather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    all_reduce_s: float = 0.0
    broadcast_s: float = 0.0
    tier_wait_s: float = 0.0


PHASES = ("forward_s", "backward_s", "optimizer_s", "all_gather_s", "reduce_scatter_s",
          "all_reduce_s", "broadcast_s", "tier_wait_s")
"""StepFigures' phase fields, filled when the spec asks for time_phases."""


@dataclass
class RankResult:
    rank: int
    world_size: int
    node: str
    device: str
    steps: list[StepFigures]
    state: dict | None = None  # {"blocks": [{name: tensor}], "persistent": {name: tensor}}


LLAMA_DEFAULTS = {"tie_word_embeddings": False, "attn_implementation": "sdpa"}


def llama_config(hf_llama: dict):
    """The transformers.LlamaConfig `hf_llama` describes (LLAMA_DEFAULTS where it is
    silent); a key LlamaConfig does not know is refused by name, not silently kept."""
    try:
        import transformers
    except ImportError:
        raise InvalidArgumentError("hf_llama needs the transformers package: pip install "
                                   "transformers") from None
    known = set(inspect.signature(transformers.LlamaConfig.__init__).parameters)
    known |= set(transformers.LlamaConfig().to_dict()) | set(LLAMA_DEFAULTS)
    unknown = sorted(set(hf_llama) - known)
    if unknown:
        raise InvalidArgumentError(
            f"hf_llama.{unknown[0]} is not a LlamaConfig field (transformers "
            f"{transformers.__version__}); give LlamaConfig keyword arguments such as "
            f"hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
            f"intermediate_size, vocab_size")
    return transformers.LlamaConfig(**{**LLAMA_DEFAULTS, **hf_llama})


def build_model(spec: PartitionedSpec, device: torch.device | str
                ) -> tuple[torch.nn.Module, str, Callable[[torch.nn.Module, torch.device], None]]:
    """The model of `spec` with its blocks not created yet, so it never sits whole in host
    memory: the engine creates each block on the device just before storing it, then the
    rest. Returns the model, the dotted name of its blocks and the engine's `initialize`."""
    if spec.hf_llama is None:
        return build_gpt(spec.gpt, device), "blocks", materialize
    from tierstack.worker.jobs import hf_model

    hf = hf_model.from_config(llama_config(spec.hf_llama))
    return hf.model, hf.blocks_attr, hf.initialize


def vocab_size(spec: PartitionedSpec) -> int:
    """The size of the trained model's vocabulary (token ids are below it)."""
    return llama_config(spec.hf_llama).vocab_size if spec.hf_llama is not None else spec.gpt.vocab_size


def global_batches(spec: PartitionedSpec):
    """The run's global batches, identical on every rank (same seed)."""
    vocab = vocab_size(spec)
    if spec.data == "stdlib":
        if vocab < 256:
            raise InvalidArgumentError(f"data 'stdlib' is bytes (token ids up to 255), the model's "
                                       f"vocabulary has {vocab}; use data 'random' or a vocab_size "
                                       f"of at least 256")
        batches = ByteBatches(stdlib_bytes(), spec.gpt.seq_len, spec.global_batch, seed=spec.seed)
        while True:
            yield batches.next()
    elif spec.data == "random":
        g = torch.Generator().manual_seed(spec.seed + 1)
        shape = (spec.global_batch, spec.gpt.seq_len)
        while True:
            yield (torch.randint(0, vocab, shape, generator=g),
                   torch.randint(0, vocab, shape, generator=g))
    else:
        raise InvalidArgumentError(f"data {spec.data!r}: use 'stdlib' or 'random'")


def rank_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of the global batch's rows."""
    if batch.shape[0] % world:
        raise InvalidArgumentError(
            f"global batch of {batch.shape[0]} does not split evenly over {world} ranks; "
            f"use a multiple of {world}")
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def run_rank(env: RankEnv, spec: PartitionedSpec) -> RankResult:
    """Train this rank's part of `spec`; see the module docstring."""
    device = rank_device(env, spec.device)
    if spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    init_process_group(env, device)
    try:
        torch.manual_seed(spec.seed)  # every rank builds the same initial model
        model, blocks_attr, initialize = build_model(spec, device)
        # The partitioned job's budgets: no HBM budget (every block streamed), unless stated.
        config = TierstackConfig(train=spec.train_config(),
                                 tier_manager=load_config({"tier_manager": spec.embedded or {}}).tier_manager,
                                 budgets=BudgetsConfig(hbm=0))
        if spec.scheduler:
            config.scheduler.listen = spec.scheduler
        job = open_job(JobSpec(
            spec.job or f"train-{uuid.uuid4().hex[:8]}", config, model, blocks_attr, device,
            initialize=initialize, partitioned=True, tier_manager=spec.tier_manager or "",
            tier_manager_setting="the spec's tier_manager",
            scheduler=SchedulerUse.AUTO if spec.scheduler else SchedulerUse.OFF,
            device_budget=spec.device_budget, device_budget_layers=spec.device_budget_layers,
            total_steps=spec.steps))
        try:
            return _train(env, spec, job)
        finally:
            job.close()
    finally:
        dist.destroy_process_group()


def _train(env: RankEnv, spec: PartitionedSpec, job: Job) -> RankResult:
    engine, store = job.engine, job.store
    model, device = engine.model, store.device
    start = _resume(spec, engine) if spec.resume else 0
    if start:
        job.starting_at(start)

    def save(step: int) -> None:
        save_tagged(engine, spec.checkpoint_dir, f"global_step{step}",
                    extra={"step": step, **_signature(spec)}, keep=1)

    def on_step(record) -> None:
        done = start + record.index + 1
        job.step_done(done, record.seconds, record.loss,
                      spec.global_batch * spec.gpt.seq_len // env.world_size,
                      engine.param_groups[0]["lr"])
        if spec.checkpoint_dir and spec.checkpoint_every and done % spec.checkpoint_every == 0 \
                and done < spec.steps:
            save(done)

    # Same seed, same batches: a resumed run skips the ones already trained on.
    batches = ((rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size))
               for x, y in itertools.islice(global_batches(spec), start, None))

    phases = engine.time_phases() if spec.time_phases else None

    def counters() -> dict[str, float]:
        node, optimizer, mine = store.tiers.stats(), engine.block_optimizer, store.figures()
        moved = store.collectives
        timed = {} if phases is None else {f"{name}_s": s for name, s in phases.totals().items()}
        return {"cpu_pool_read": mine.bytes_read, "cpu_pool_written": mine.bytes_written,
                "nvme_read": node.nvme_bytes_read, "nvme_written": node.nvme_bytes_written,
                "gathered": moved.bytes_gathered, "exchanged": moved.bytes_exchanged,
                "stalled_s": mine.stall_seconds, "daemon_adamw_s": optimizer.update_seconds,
                "daemon_state_reads_s": optimizer.wait_seconds,
                **{name: timed.get(name, 0.0) for name in PHASES}}

    steps = [StepFigures(r.loss, r.seconds, **{k: v if k.endswith("_s") else int(v)
                                               for k, v in r.moved.items()})
             for r in run_steps(engine.train_step, batches, device, spec.steps - start,
                                counters=counters, on_step=on_step)]
    if spec.checkpoint_dir:
        save(spec.steps)
    if spec.export:
        export_safetensors(engine, spec.export)
    state = None
    if spec.collect_state:
        state = {"blocks": [store.read_layer(i) for i in range(store.layer_count())],
                 "persistent": {n: p.detach().cpu().clone() for n, p in model.named_parameters()
                                if not is_parked(p)}}
    node = os.uname().nodename
    return RankResult(env.rank, env.world_size, node, str(device), steps, state)


def _signature(spec: PartitionedSpec) -> dict:
    """What a checkpoint must match to be resumed: the model, its precision, the data."""
    return {"gpt": asdict(spec.gpt), "hf_llama": spec.hf_llama, "precision": spec.precision,
            "global_batch": spec.global_batch, "seed": spec.seed, "data": spec.data}


def _resume(spec: PartitionedSpec, engine: OffloadEngine) -> int:
    """Load the checkpoint `spec.checkpoint_dir`/latest names into the engine (on every
    rank); the steps it had done."""
    if not spec.checkpoint_dir:
        raise InvalidArgumentError("resume needs checkpoint_dir: the checkpoint to continue from")
    extra = load_checkpoint(engine, find(spec.checkpoint_dir))
    saved = {k: extra.get(k) for k in _signature(spec)}
    if saved != _signature(spec):
        differs = sorted(k for k, v in _signature(spec).items() if saved[k] != v)
        raise InvalidArgumentError(f"{spec.checkpoint_dir} was saved from another run ({', '.join(differs)} "
                                   f"differ); resume with the spec it was saved with")
    if extra["step"] >= spec.steps:
        raise InvalidArgumentError(f"{spec.checkpoint_dir} is at step {extra['step']} already; "
                                   f"give steps > {extra['step']} to train on")
    return extra["step"]


def spec_from_dict(data: dict) -> PartitionedSpec:
    """A spec from plain data (JSON on a command line)."""
    data = dict(data)
    gpt = GPTConfig(**data.pop("gpt", {}))
    optimizer = load_config({"train": {"optimizer": data.pop("optimizer", {})}}).train.optimizer
    return PartitionedSpec(gpt=gpt, optimizer=optimizer, **data)


def small_embedded_node(size_mib: int = 64) -> dict:
    """A tier_manager config for an embedded per-rank daemon (CPU pool + NVMe, under the
    config's one default NVMe root)."""
    tm = TierManagerConfig()
    tm.cpu_pool.size = size_mib * MiB
    tm.nvme_pool.size = 1024 * MiB
    return config_dict(tm)


def main(argv: list[str] | None = None) -> int:
    """One rank under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_*).

    torchrun --nproc-per-node 2 -m tierstack.worker.jobs.partitioned_job --spec '{"steps": 5}'
    (a Hugging Face LLaMA: --spec '{"hf_llama": {"hidden_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "intermediate_size": 1376}, "data": "random", "precision": "bf16"}')
    Each rank starts its own embedded tier manager unless the spec names one
    ("tier_manager"); every rank prints one JSON line with its per-step figures.
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(description="one rank of a partitioned training run")
    parser.add_argument("--spec", default="{}", help="PartitionedSpec fields as JSON")
    args = parser.parse_args(argv)
    spec = spec_from_dict(json.loads(args.spec))
    if spec.tier_manager is None and spec.embedded is None:
        spec.embedded = small_embedded_node()
    result = run_rank(RankEnv.from_environ(), spec)
    steps = result.steps[1:] or result.steps
    median = lambda f: sorted(getattr(s, f) for s in steps)[len(steps) // 2]  # noqa: E731
    print(json.dumps({"rank": result.rank, "world_size": result.world_size, "device": result.device,
                      "losses": [round(s.loss, 5) for s in result.steps],
                      "step_s": median("seconds"), "cpu_pool_read": median("cpu_pool_read"),
                      "nvme_read": median("nvme_read"), "nvme_written": median("nvme_written"),
                      "gathered": median("gathered")}), flush=True)
    return 0


def _run_rank_to_file(env: RankEnv, spec: PartitionedSpec, out_dir: str) -> None:
    torch.save(run_rank(env, spec), os.path.join(out_dir, f"rank{env.rank}.pt"))


def launch_partitioned(spec: PartitionedSpec, world: int) -> list[RankResult]:
    """Run `spec` on `world` local processes (no Ray); every rank's result, by rank."""
    from tierstack.worker.node.distributed import launch_local

    out_dir = tempfile.mkdtemp(prefix="tierstack-ranks-")
    try:
        launch_local(_run_rank_to_file, world, spec, out_dir)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
