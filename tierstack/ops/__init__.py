"""`deepspeed.ops`: DeepSpeed's optimizers under their names (tierstack/ops/adam.py).

DeepSpeed's other kernels (transformer, sparse attention, quantizer, aio) are not part of
tierstack: asking for one raises an AttributeError that names what to use instead.
"""

from tierstack.ops import adam


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"tierstack.ops has no {name}: tierstack offers DeepSpeed's Adam "
                         f"optimizers only (tierstack.ops.adam); use torch's modules for the rest")
