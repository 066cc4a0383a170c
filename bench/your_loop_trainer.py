"""A Hugging Face Trainer script, run with the Trainer's DeepSpeed integration or, with
YOUR_LOOP_IMPL=tierstack, with tierstack's (the one import line below). bench/your_loop.py
runs both side by side and compares Hugging Face's own train_samples_per_second.

    python3 bench/your_loop_trainer.py --model 1.3b --steps 30 --config ds.json --output-dir out
Prints one line `RESULT {json}`: the Trainer's train metrics and the GPU peak.
"""

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from your_loop_script import MODELS  # the same model shapes as the script runs

if os.environ.get("YOUR_LOOP_IMPL") == "tierstack":
    from tierstack.worker.hf_trainer import Trainer, TrainingArguments  # the changed line
else:
    from transformers import Trainer, TrainingArguments

class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token rows (inputs and labels alike), as a tokenised corpus gives them."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    ds = json.load(open(args.config))
    micro = ds["train_micro_batch_size_per_gpu"]
    optimizer = ds["optimizer"]["params"]
    warmup = ds["scheduler"]["params"]["warmup_num_steps"]
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[args.model], max_position_embeddings=args.seq,
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=micro, max_steps=args.steps,
        gradient_accumulation_steps=ds["gradient_accumulation_steps"], bf16=True,
        learning_rate=optimizer["lr"], adam_beta1=optimizer["betas"][0], adam_beta2=optimizer["betas"][1],
        adam_epsilon=optimizer["eps"], weight_decay=optimizer["weight_decay"], warmup_steps=warmup,
        max_grad_norm=ds["gradient_clipping"], logging_steps=10, save_strategy="no",
        report_to="none", dataloader_num_workers=0, deepspeed=args.config,
        use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=training,
                      train_dataset=RandomTokens(micro * args.steps, args.seq, config.vocab_size))
    result = trainer.train()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    print("RESULT " + json.dumps({**result.metrics, "gpu_peak": peak,
                                  "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}),
          flush=True)
    if hasattr(trainer, "end"):
        trainer.end()


if __name__ == "__main__":
    main()
