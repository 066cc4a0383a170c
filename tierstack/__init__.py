"""tierstack: training state across GPU HBM, CPU DRAM and NVMe, run as services.

`tierstack.initialize(...)` is `deepspeed.initialize` for tierstack's engine, and
`tierstack.init_distributed()` DeepSpeed's call of that name (worker/initialize.py); both
are imported on first use, so `import tierstack` stays light.
"""


def __getattr__(name: str):
    if name in ("initialize", "init_distributed"):
        from tierstack.worker import initialize as module

        return getattr(module, name)
    raise AttributeError(f"module 'tierstack' has no attribute {name!r}")
