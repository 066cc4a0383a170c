"""`deepspeed.zero` for `import tierstack as deepspeed`: `Init` (a model built never whole in
host memory) and `GatheredParameters` (read and change weights that live in the tiers),
with DeepSpeed's names. They are the worker's (worker/api/zero.py)."""

from tierstack.worker.api.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
