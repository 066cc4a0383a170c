"""The flags of `tierstack train`, and the checks that need nothing heavy.

Kept apart from the job (train_job.py, which imports torch and the whole SDK: seconds):
a flag that is wrong, contradicts another, or names a tier manager that does not answer
is refused in one line before any of that is imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tierstack import arguments as types
from tierstack.checkpoint_layout import LATEST_FILE, find, latest_tag, tags
from tierstack.errors import ConfigError, InvalidArgumentError
from tierstack.worker.node.daemon_address import check_reachable

GPT_DEFAULTS = {"dim": 384, "layers": 8, "heads": 6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (the built-in byte-level GPT unless --hf-model)")
    model.add_argument("--hf-model", metavar="PATH",
                       help="a Hugging Face causal LM: its config.json, or a model directory "
                            "(config.json, optional weights and tokenizer); local files only")
    model.add_argument("--hf-init", choices=["auto", "weights", "config"], default="auto",
                       help="with --hf-model: start from the directory's weights, or initialise "
                            "from the config (default auto: weights when the directory has them)")
    model.add_argument("--dim", type=types.positive_int,
                       help=f"GPT hidden size (default {GPT_DEFAULTS['dim']})")
    model.add_argument("--layers", type=types.positive_int,
                       help=f"GPT blocks (default {GPT_DEFAULTS['layers']})")
    model.add_argument("--heads", type=types.positive_int,
                       help=f"GPT attention heads, dividing --dim (default {GPT_DEFAULTS['heads']})")
    model.add_argument("--seq-len", type=types.positive_int, default=128,
                       help="tokens per training sequence (default 128)")
    model.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                       help="default: the config's train.precision (fp32); fp16 scales the loss "
                            "dynamically (the config's train.fp16)")

    data = parser.add_argument_group("data and steps")
    data.add_argument("--data", metavar="FILE",
                      help="a local text file to train on (default: the Python standard "
                           "library's sources); bytes are the tokens unless the model "
                           "directory has a tokenizer")
    data.add_argument("--steps", type=types.positive_int, default=80,
                      help="optimizer steps in all (a resumed run continues up to this; default 80)")
    data.add_argument("--batch-size", type=types.positive_int, default=None,
                      help="rows per optimizer step; default: the config's train.micro_batch_size x "
                           "train.gradient_accumulation_steps (8 x 1) x --ranks")
    data.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    data.add_argument("--lr", type=types.positive_float, default=None,
                      help="peak learning rate (default: the config's train.optimizer.lr, 1e-3)")
    data.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default=None,
                      help="a linear warm-up over --warmup-steps, then the lr held (constant), "
                           "decayed linearly to 0 at --steps (linear) or along a cosine to 0 "
                           "(cosine); default: the config's train.lr_schedule (none)")
    data.add_argument("--warmup-steps", type=types.non_negative_int, default=None,
                      help="steps of linear warm-up from 0 with --lr-schedule (default 0)")

    tiers = parser.add_argument_group("where the state lives")
    tiers.add_argument("--config", help="a tierstack or DeepSpeed JSON config (default: blocks' "
                                        "parameters and optimizer state on NVMe)")
    tiers.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when there is one)")
    tiers.add_argument("--device-budget", type=types.size, default=None,
                       help="device bytes for layers, e.g. 2GiB; default: the config's "
                            "train.device_budget (0: 3 layers' worth)")
    tiers.add_argument("--cpu-pool-size", type=types.positive_size_or_auto, default=None,
                       help="cap on the embedded tier manager's CPU pool, or 'auto' (default: "
                            "the config's tier_manager.cpu_pool.size, 'auto': the host budget's "
                            "share; the pool grows to what is stored, never past the cap)")
    tiers.add_argument("--nvme-path", default=None,
                       help="directory for the embedded tier manager's NVMe pool; a subdirectory "
                            "named after the job is used and removed (default: the config's "
                            "NVMe paths, e.g. a DeepSpeed JSON's nvme_path, else "
                            "/var/tmp/tierstack-<uid>/nvme)")

    services = parser.add_argument_group("services and ranks")
    services.add_argument("--tier-manager", metavar="ADDRESS",
                          help="use this running tier manager (unix:/path or host:port) instead "
                               "of starting one")
    services.add_argument("--no-scheduler", action="store_true",
                          help="do not start the embedded scheduler (fixed prefetch depth)")
    services.add_argument("--ranks", type=types.positive_int, default=1,
                          help="data-parallel ranks, each a Ray actor keeping 1/N of every block "
                               "(partitioned training); --batch-size is the global batch")
    services.add_argument("--address", help="join this Ray cluster (auto, or the head's host:port) "
                                            "instead of starting Ray here; implies Ray actors")
    services.add_argument("--placement", default="SPREAD",
                          choices=["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"],
                          help="Ray placement strategy of the ranks (default SPREAD)")

    state = parser.add_argument_group("checkpoints, export and output")
    state.add_argument("--checkpoint-dir", metavar="DIR",
                       help="save the whole training state here at the end (and every "
                            "--checkpoint-every steps), one block at a time, as DeepSpeed lays "
                            "it out: DIR/global_step<N>/ and DIR/latest")
    state.add_argument("--checkpoint-every", type=types.non_negative_int, default=0,
                       help="steps between checkpoints (default 0: only at the end)")
    state.add_argument("--keep-checkpoints", type=types.non_negative_int, default=1, metavar="N",
                       help="checkpoints kept in --checkpoint-dir, the newest (default 1: each "
                            "replaces the last once it is whole; 0 keeps every one)")
    state.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint DIR/latest names in --checkpoint-dir "
                            "(same model and flags), up to --steps")
    state.add_argument("--export", metavar="DIR",
                       help="write the trained weights as safetensors (+ config) that "
                            "from_pretrained loads")
    state.add_argument("--log-every", type=types.non_negative_float, default=10.0,
                       help="seconds between progress lines when the output is not a terminal "
                            "(default 10; a last line always comes at the end)")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse contradicting or impossible flags with one line each, before anything starts."""
    gpt_flags = [f"--{k}" for k in GPT_DEFAULTS if getattr(args, k) is not None]
    if args.hf_model and gpt_flags:
        raise ConfigError(f"{', '.join(gpt_flags)} size the built-in GPT; with --hf-model the "
                          f"Hugging Face config sets the model's size, so leave them out")
    if not args.hf_model:
        for key, value in GPT_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.dim % args.heads:
            fits = [h for h in range(1, args.dim + 1) if args.dim % h == 0]
            near = min(fits, key=lambda h: abs(h - args.heads))
            raise ConfigError(f"--dim {args.dim} does not split into --heads {args.heads} equal "
                              f"attention heads; use --heads {near}, or a --dim that is a multiple "
                              f"of {args.heads} (e.g. {args.heads * max(1, args.dim // args.heads)})")
    if args.warmup_steps is not None and args.lr_schedule is None:
        raise ConfigError("--warmup-steps needs --lr-schedule (constant, linear or cosine): the "
                          "warm-up is the start of a schedule")
    if args.resume and not args.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir: the directory of the checkpoint to "
                          "continue from")
    if args.resume:  # the tag `latest` names, as the engine's load_checkpoint reads it
        directory = Path(args.checkpoint_dir)
        try:
            there = tags(directory)
            if there and latest_tag(directory) is None:
                raise ConfigError(f"--resume: {directory} has no '{LATEST_FILE}' file; write the tag "
                                  f"to resume from into it (tags there: {', '.join(there)})")
            find(directory)
        except InvalidArgumentError as e:
            raise ConfigError(f"--resume: {e}") from None
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to save)")
    if args.ranks > 1 or args.address:
        given = [flag for flag, value in (("--hf-model", args.hf_model), ("--checkpoint-dir",
                 args.checkpoint_dir), ("--export", args.export), ("--data", args.data)) if value]
        if given:
            raise ConfigError(f"partitioned training (--ranks, --address) does not take "
                              f"{', '.join(given)} yet; train on one rank to use them")
    if args.data and not Path(args.data).is_file():
        raise ConfigError(f"--data {args.data}: no such file; give a local text file")


def run(args: argparse.Namespace) -> int:
    """`tierstack train`: the flags checked, then the job."""
    check_arguments(args)
    if args.tier_manager and not (args.ranks > 1 or args.address):
        check_reachable(args.tier_manager)
    from tierstack.worker.jobs.train_job import run as run_job

    return run_job(args)
