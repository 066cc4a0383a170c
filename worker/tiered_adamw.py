"""AdamW over offloaded blocks: parameters, gradients and moments stay in the tiers.

For each block in turn the step reads its parameters, gradients and the two moment
buffers from the tier manager (kinds "params", "grad", "exp_avg", "exp_avg_sq"), runs
PyTorch's own AdamW kernel on the CPU (`torch.optim.adamw.adamw`, fused by default),
and writes parameters and moments back. No block's state is on the device at any time.

With `masters`, AdamW updates the fp32 master weights (kind "master") from the
low-precision gradients, and the layer's parameters are written back as the masters
rounded to the layer's dtype.

Reading block i+1, updating block i and writing block i-1 overlap. Not yet here (see
the issue): running the step inside the tier manager itself.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch.optim import adamw

from tierstack.config import OptimizerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.worker.offload import OffloadedBlocks

MOMENTS = ("exp_avg", "exp_avg_sq")


class TieredAdamW:
    """AdamW for the parameters of an `OffloadedBlocks`, state kept by the tier manager."""

    def __init__(self, blocks: OffloadedBlocks, config: OptimizerConfig | None = None,
                 fused: bool = True, masters: bool = False) -> None:
        self.blocks = blocks
        self.masters = masters
        self.config = config or OptimizerConfig()
        self.config.validate("optimizer")
        self.fused = fused
        self.steps = 0
        self._has_moments: set[int] = set()  # blocks whose moments the tier manager holds

    def step(self) -> None:
        """One AdamW step for every block, from the gradients of the last backward.

        Three legs overlap: block i+1's state is read while block i is updated, and
        block i's results are written while block i+1 is updated.
        """
        count = len(self.blocks.blocks)
        missing = [i for i in range(count) if not self.blocks.has_gradients(i)]
        if missing:  # check first: a step must update every block or none
            raise InvalidArgumentError(
                f"blocks {missing} have no gradients since the last zero_grad: run a backward "
                f"through every offloaded block before the optimizer step")
        step = self.steps + 1
        writes = []
        with ThreadPoolExecutor(2, thread_name_prefix="tierstack-adam-io") as io:
            pending = io.submit(self._read, 0) if count else None
            for i in range(count):
                state = pending.result()
                if i + 1 < count:
                    pending = io.submit(self._read, i + 1)
                self._update(state, step)
                writes.append(io.submit(self._write, i, state))
            for w in writes:
                w.result()  # surface a failed write
        self._has_moments.update(range(count))
        self.steps = step  # counted only once every block's update is stored

    def _read(self, i: int) -> dict:
        store = self.blocks.store
        grads = {n: g.float() for n, g in self.blocks.gradients(i).items()}
        stored = store.read_layer(i)
        names = sorted(grads)
        if self.masters:
            saved = store.read_layer(i, "master")
            params = [saved[f"{n}.master"] for n in names]
        else:
            params = [stored[n] for n in names]
        if i not in self._has_moments:
            moments = {kind: [torch.zeros_like(p) for p in params] for kind in MOMENTS}
        else:
            moments = {}
            for kind in MOMENTS:
                saved = store.read_layer(i, kind)
                moments[kind] = [saved[f"{n}.{kind}"] for n in names]
        return {"names": names, "grads": [grads[n] for n in names], "stored": stored,
                "params": params, "moments": moments}

    def _update(self, state: dict, step: int) -> None:
        beta1, beta2 = self.config.betas
        # AdamW increments each step counter itself: hand it the count before this step.
        counters = [torch.tensor(float(step - 1)) for _ in state["names"]]
        adamw.adamw(state["params"], state["grads"], state["moments"]["exp_avg"],
                    state["moments"]["exp_avg_sq"], [], counters, foreach=False, fused=self.fused,
                    amsgrad=False, beta1=beta1, beta2=beta2, lr=self.config.lr,
                    weight_decay=self.config.weight_decay, eps=self.config.eps, maximize=False)

    def _write(self, i: int, state: dict) -> None:
        store = self.blocks.store
        names, params, stored = state["names"], state["params"], state["stored"]
        if self.masters:
            store.write_back(i, {f"{n}.master": p for n, p in zip(names, params)}, kind="master")
            for n, p in zip(names, params):
                stored[n].copy_(p)  # rounded to the layer's dtype
        store.write_back(i, stored)  # parameters: all of the layer's tensors
        for kind in MOMENTS:
            store.write_back(i, {f"{n}.{kind}": t for n, t in zip(names, state["moments"][kind])},
                             kind=kind)
