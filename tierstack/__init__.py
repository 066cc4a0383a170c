"""tierstack: training state across GPU HBM, CPU DRAM and NVMe, run as services.

`tierstack.initialize(...)` is `deepspeed.initialize` for tierstack's engine
(worker/initialize.py); it is imported on first use, so `import tierstack` stays light.
"""


def __getattr__(name: str):
    if name == "initialize":
        from tierstack.worker.initialize import initialize

        return initialize
    raise AttributeError(f"module 'tierstack' has no attribute {name!r}")
