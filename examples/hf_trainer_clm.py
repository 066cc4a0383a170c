"""A Hugging Face Trainer script (run_clm style) that trains through tierstack.

    python examples/hf_trainer_clm.py --output_dir /tmp/clm --deepspeed examples/ds_config_zero3.json

A tiny Llama learns a paragraph byte by byte, on the CPU in well under a minute. It is a
plain transformers script (HfArgumentParser over transformers' own TrainingArguments) but
for the one line marked "tierstack"; the DeepSpeed JSON is a stock file of Hugging Face's
docs, its "auto" values unchanged: ZeRO-3 offload, or ZeRO-2 with the optimizer offloaded
(examples/ds_config_zero2.json); leave --deepspeed out for tierstack's defaults. Every
TrainingArguments flag works as usual, --gradient_checkpointing too.
"""

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainingArguments, set_seed

from tierstack.worker.hf_trainer import Trainer  # tierstack: was `from transformers import Trainer`

TEXT = (
    "Parameters, gradients and optimizer states live across three tiers: GPU memory, CPU "
    "memory and NVMe. They move to the GPU just in time, layer by layer, overlapped with "
    "compute, so a model whose training state does not fit in GPU memory still trains. "
) * 8


class ByteBlocks(torch.utils.data.Dataset):
    """The text's bytes (token ids 0-255) in overlapping blocks: inputs and labels alike."""

    def __init__(self, text: str, length: int, stride: int) -> None:
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.blocks = [data[i:i + length] for i in range(0, len(data) - length, stride)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = HfArgumentParser(TrainingArguments)
    parser.set_defaults(max_steps=40, per_device_train_batch_size=8, learning_rate=3e-3,
                        warmup_steps=4, logging_steps=10, save_strategy="no", report_to="none")
    (args,) = parser.parse_args_into_dataclasses()
    set_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    trainer = Trainer(model=model, args=args, train_dataset=ByteBlocks(TEXT, 32, 7),
                      eval_dataset=ByteBlocks(TEXT[:300], 32, 32))
    result = trainer.train()
    print(result.metrics)  # transformers' own: train_samples_per_second, train_loss, ...
    print(trainer.evaluate())
    trainer.save_model()  # loadable with LlamaForCausalLM.from_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
