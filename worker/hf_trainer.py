"""The Hugging Face Trainer door's public import path, kept stable for users' scripts.

    from tierstack.worker.hf_trainer import Trainer  # transformers' TrainingArguments stay

Importing it has transformers' TrainingArguments read a DeepSpeed JSON for tierstack;
`TrainingArguments` here is that same class. The door itself lives with the other doors in
worker/api/hf_trainer.py."""

from tierstack.worker.api.hf_trainer import Trainer, TrainingArguments

__all__ = ["Trainer", "TrainingArguments"]
