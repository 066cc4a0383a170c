"""A DeepSpeed training script as DeepSpeed's tutorials write one, with only its import changed
(`import deepspeed` -> `import tierstack as deepspeed`): the model built under zero.Init,
the accelerator for its device,
deepspeed.comm for ranks and reductions, activation checkpointing inside the model, a
DeepSpeed optimizer passed to initialize, the config read through DeepSpeedConfig and
argparse, its own loop, and a report. tests/worker/test_deepspeed_surface.py runs it.

Each rank prints one line `REPORT {json}` at the end: what it computed and what it read."""

import argparse
import json

import torch

import tierstack as deepspeed
from deepspeed.accelerator import get_accelerator
import deepspeed.comm as dist
import deepspeed.zero
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

from ds_surface_model import Net, batches, loss_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--optimizer", choices=["cpu_adam", "fused_adam"], default="cpu_adam")
    parser.add_argument("--checkpoint-in-cpu", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    accelerator = get_accelerator()
    device = torch.device(accelerator.current_device_name())
    accelerator.manual_seed_all(0)
    torch.manual_seed(0)
    deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config,
                                      checkpoint_in_cpu=args.checkpoint_in_cpu)
    ds_config = deepspeed.DeepSpeedConfig(args.deepspeed_config)

    # Built as DeepSpeed's ZeRO-3 scripts build a model: never whole in host memory.
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = Net(checkpoint=deepspeed.checkpointing.checkpoint)
    make = DeepSpeedCPUAdam if args.optimizer == "cpu_adam" else FusedAdam
    optimizer = make(model.parameters(), lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                   model_parameters=model.parameters())
    assert isinstance(engine, deepspeed.DeepSpeedEngine)

    losses, reduced = [], []
    accelerator.reset_peak_memory_stats()
    # Each rank trains its own rows (one rank: seed 1).
    for ids in batches(1 + dist.get_rank(), args.steps * engine.gradient_accumulation_steps(), device):
        loss = loss_of(engine(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        reduced.append((mean / dist.get_world_size()).item())
    accelerator.synchronize()
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
    flag = torch.tensor([7.0 + dist.get_rank()])
    dist.broadcast(flag, src=0)
    dist.barrier()
    engine.monitor.write_events([("Train/Eval/loss", losses[-1], engine.global_samples)])

    # Every rank reports: the test reads rank 0's figures and each rank's losses.
    print("REPORT " + json.dumps({
        "version": deepspeed.__version__,
        "device": accelerator.device_name(), "device_name": accelerator.current_device_name(),
        "device_count": accelerator.device_count(), "available": accelerator.is_available(),
        "backend": accelerator.communication_backend_name(),
        "memory_allocated": accelerator.memory_allocated(),
        "max_memory_allocated": accelerator.max_memory_allocated(),
        "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "local_rank": dist.get_local_rank(), "dist_initialized": dist.is_initialized(),
        "gathered": [t.item() for t in gathered], "broadcast": flag.item(),
        "checkpointing_configured": deepspeed.checkpointing.is_configured(),
        "config": {"train_batch_size": ds_config.train_batch_size,
                   "micro": ds_config.train_micro_batch_size_per_gpu,
                   "accumulation": ds_config.gradient_accumulation_steps,
                   "stage": ds_config.zero_optimization_stage,
                   "fp16": ds_config.fp16_enabled, "bf16": ds_config.bfloat16_enabled,
                   "steps_per_print": ds_config.steps_per_print},
        "losses": losses, "reduced": reduced, "lr": engine.get_lr(), "mom": engine.get_mom(),
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "optimizer": type(optimizer).__name__,
    }), flush=True)


if __name__ == "__main__":
    main()
