"""tierstack: training state across GPU HBM, CPU DRAM and NVMe, run as services.

`tierstack.initialize(...)` is `deepspeed.initialize` for tierstack's engine, and
`tierstack.init_distributed()` and `tierstack.add_config_arguments(parser)` DeepSpeed's
calls of those names (worker/api/initialize.py); all are imported on first use, so `import tierstack` stays light.
"""


def __getattr__(name: str):
    if name in ("initialize", "init_distributed", "add_config_arguments"):
        from tierstack.worker.api import initialize as module

        return getattr(module, name)
    if name == "zero":
        from tierstack.worker.api import zero

        return zero
    raise AttributeError(f"module 'tierstack' has no attribute {name!r}")
