"""Offloaded blocks: a ModuleList whose parameters live in the tiers, not on the device.

`OffloadedBlocks` registers each block's tensors with the node's tier manager (one
contiguous block per layer, through the store), keeps only placeholders in the blocks
(worker/engine/block_views.py: each parameter keeps its shape and name, its bytes are in
the tiers), and gives each block a forward of its own, so the model's own forward (a plain
GPT's loop, Hugging Face's decoder loop with its masks and rotary embeddings passed as
keyword arguments) runs unchanged. The blocks stay where they were in the model: its
parameters, attribute access and `state_dict()` (every value read from the tiers, one
block at a time) see the whole model. Forward runs block i with its tensors brought in by `ensure_layer(i)`
(prefetching the next ones) and drops them right after; nothing but the block's input
is saved (on the device, or with the tier manager: the block's activation policy, see
activation_stash.py). Backward recomputes block i from that input with its tensors brought in again
(prefetching in reverse order), computes the gradients of the input and of the block's
parameters, and writes the parameter gradients to the tier manager (kind "grad") as
soon as the block is done. Outside a block's use window none of its bytes stay on the
device, and the layer store keeps the device budget.

The recompute costs one extra forward per block (as activation checkpointing does) and
in exchange never holds a parameter across the forward/backward gap. Like
torch.utils.checkpoint, the recompute replays the forward's RNG state (dropout) and
autocast setting. Where the device has room (the engine's placement decides), a block
instead keeps its activations: its tensors stay on the device from its forward to its
backward, which runs the saved graph (`keep_activations`, no recompute). A block can
also be made resident (`make_resident`): its tensors come to the device for good and it
becomes an ordinary module of the model again. Gradients accumulate over several
backward passes (and several calls of a block) until `new_gradients()`, which the
engine's zero_grad calls.

Not supported, refused by name: weights tied inside a block, buffers a block updates in
place (BatchNorm running statistics), and a key/value cache passed to a block.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable

import torch
import torch.utils.checkpoint

from tierstack.dtypes import dtype_from_name
from tierstack.errors import InvalidArgumentError
from tierstack.tiers import AUTO
from tierstack.worker.engine.activation_stash import ActivationStash
from tierstack.worker.engine.block_views import is_parked, park, unpark
from tierstack.worker.store.grad_norm import squared_norm
from tierstack.worker.engine.gradient_writes import GradientWrites
from tierstack.worker.store.block_store import BlockStore
from tierstack.worker.engine.placement import SavedBytes


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Point parameter or buffer `name` (dotted) of `module` at `value` (no copy)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        unpark(owner._parameters[leaf], value)
    else:
        owner._buffers[leaf] = value


class _Block(torch.autograd.Function):
    """Runs one offloaded block forward without saving its activations.

    `extra` is (args, kwargs) for the block beyond its first input; tensors there must
    not need gradients (masks, positions, rotary tables), which the proxy checks.
    """

    @staticmethod
    def forward(ctx, engine: "OffloadedBlocks", index: int, x: torch.Tensor, extra: tuple,
                anchor: torch.Tensor, training: bool):
        # `anchor` needs gradients, so this node is in the graph even when `x` does not
        # (a frozen embedding): the block's parameters still get theirs.
        ctx.engine, ctx.index, ctx.extra = engine, index, extra
        ctx.replay = _ReplayState.capture(x.device)
        placement = engine.input_tiers[index] if training else None
        if training and placement is None and engine.measure_activations:
            placement = engine.probe_input_tier(index, x)
        # The input goes to the tier manager (its placement) or stays on the device; not
        # outside training: no backward would ever take it back.
        ctx.stashed = None if placement is None else engine.stash.put(index, x, placement)
        if ctx.stashed is None:
            ctx.save_for_backward(x)
        with torch.no_grad():
            return engine._forward_block(index, x, extra)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        stash, entry = ctx.engine.stash, ctx.stashed
        if entry is None:
            (x,) = ctx.saved_tensors
        else:
            x = stash.take(entry).requires_grad_(entry.requires_grad)
        try:
            grad_in = ctx.engine._backward_block(ctx.index, x, ctx.extra, grad_out, ctx.replay)
        finally:
            if entry is not None:
                stash.release(entry)
        return None, None, grad_in, None, None, None


class _KeptBlock(torch.autograd.Function):
    """Runs one offloaded block forward keeping its activations: the block's graph is
    built on a detached input, kept in `ctx`, and run by the backward (no recompute).
    The block's tensors stay on the device until then."""

    @staticmethod
    def forward(ctx, engine: "OffloadedBlocks", index: int, x: torch.Tensor, extra: tuple,
                anchor: torch.Tensor):
        x_in, out = engine._forward_kept(index, x, extra)
        ctx.engine, ctx.index, ctx.graph = engine, index, (x_in, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_in, out = ctx.graph
        ctx.graph = None
        grad_in = ctx.engine._backward_kept(ctx.index, x_in, out, grad_out)
        return None, None, grad_in, None, None


class _ReplayState:
    """RNG and autocast state of a block's forward, replayed for its recompute."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = torch.is_autocast_enabled(device.type)
        self.autocast_dtype = torch.get_autocast_dtype(device.type)

    @classmethod
    def capture(cls, device: torch.device) -> "_ReplayState":
        return cls(device)

    @contextlib.contextmanager
    def replaying(self):
        """Inside: RNG and autocast are as they were in the forward."""
        devices = [self.device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast):
                yield


def _needs_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    return False


class _OffloadedForward:
    """An offloaded block's forward (an instance attribute of the block): the block's own
    forward when the engine runs it with its tensors in place, else the offloaded path."""

    def __init__(self, engine: "OffloadedBlocks", index: int, original: Callable) -> None:
        self.engine, self.index, self.original = engine, index, original

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        engine = self.engine
        if engine._inside == self.index:  # the engine's own call, the block's tensors in place
            return self.original(x, *args, **kwargs)
        if _needs_grad((args, kwargs)):
            raise InvalidArgumentError(
                f"block {self.index} was given an extra input that needs gradients; offloaded "
                f"blocks pass gradients only through their first input")
        if torch.is_grad_enabled() and (kwargs.get("use_cache") or any(
                hasattr(v, "get_seq_length") for v in list(args) + list(kwargs.values()))):
            raise InvalidArgumentError(
                f"block {self.index} was given a key/value cache while training: the backward "
                f"recompute would extend it a second time; call the model with use_cache=False")
        training = torch.is_grad_enabled()
        if engine.keep_activations[self.index] and training:
            return _KeptBlock.apply(engine, self.index, x, (args, kwargs), engine._anchor)
        return _Block.apply(engine, self.index, x, (args, kwargs), engine._anchor, training)


class OffloadedBlocks(torch.nn.Module):
    """A sequence of blocks whose parameters live with the node's tier manager."""

    gathers_on_use = False
    """A value op on a parked parameter is refused, naming GatheredParameters (block_views)."""

    def __init__(self, module_list: torch.nn.ModuleList, store: BlockStore,
                 prefetch_depth: int = 2, positions: list[int] | None = None,
                 prepare: Callable[[int, torch.nn.Module], None] | None = None,
                 write_weights: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
                 prefix: str = "") -> None:
        """Offload the blocks of `module_list` at `positions` (default: all of them);
        block i here (layer i of the store) is `module_list[positions[i]]`.

        `prepare(i, block)` runs on each block just before it is stored (to create its
        tensors from the meta device, cast it): only one block is materialised at a time.
        `write_weights(i, tensors)` stores block i's weights changed by the user (inside
        GatheredParameters), masters too (default: the weights alone). `prefix`: the
        ModuleList's dotted name in the model (for the names errors give).
        """
        super().__init__()
        self.positions = list(range(len(module_list))) if positions is None else list(positions)
        # plain list: these are not the model's modules any more
        self.blocks = [module_list[p] for p in self.positions]
        self.store = store
        # The store's depths until a scheduler plan replaces them (PlanFollower).
        store.use_prefetch_depth(prefetch_depth)
        for i, block in enumerate(self.blocks):
            _check_supported(i, block)
        self._anchor = torch.empty(0, requires_grad=True)
        self._generation = 0  # gradients of the current accumulation window
        self._grad_generation = [-1] * len(self.blocks)
        # Called with a block's index once its gradients of the window are stored (the
        # engine starts that block's optimizer step there, overlapping the backward).
        self.on_gradients: Callable[[int], None] | None = None
        # Gradients go to the tier manager behind the backward where the store can take
        # them from another thread (a partitioned store's write is a collective: not there).
        self.gradient_writes = (GradientWrites(lambda i, tensors, after: store.write_back(
            i, tensors, kind="grad", durable=False, after=after))
            if store.writes_from_any_thread else None)
        # Squared L2 norm of each block's stored gradients (a device scalar), kept when
        # `track_grad_norms` is set, for global-norm clipping without reading them back.
        self.track_grad_norms = False
        self.grad_sq_norms: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._names = [list(block.state_dict().keys()) for block in self.blocks]
        # Per block: keep its activations (its tensors stay on the device from its forward
        # to its backward) instead of recomputing it; set by the engine's placement.
        self.keep_activations = [False] * len(self.blocks)
        # Per recomputed block: where its input waits for the backward, None (on the
        # device) or a tier manager placement ("cpu", "nvme", "auto"; activation_stash.py).
        self.input_tiers: list[str | None] = [None] * len(self.blocks)
        self.stash = ActivationStash(store)
        # Set by the optimizer: wait until a block's stored tensors are current (its update
        # of the last step is done) before it is used; whether that is so already.
        self.before_use: Callable[[int], None] = lambda index: None
        self.ready_for_use: Callable[[int], bool] = lambda index: True
        # While `measure_activations` is set (the engine's probe step), each block's
        # recompute counts the bytes autograd saves in its forward.
        self.measure_activations = False
        self.activation_bytes = [0] * len(self.blocks)
        self.input_bytes = [0] * len(self.blocks)  # and the bytes of its saved input
        # The probe keeps every block input on the device when all of them fit within
        # `probe_input_limit` bytes held there, else sends every one to the tier manager
        # (`probe_stashed_bytes` of them). Without it the probe of a step whose inputs
        # alone overflow HBM ran out of memory before any placement could send them out.
        self.probe_input_limit = 0
        self.probe_stashed_bytes = 0
        self._probe_keeps: bool | None = None  # decided at the probe's first input
        self.resident: set[int] = set()  # blocks brought to the device for good
        self._kept_live: set[int] = set()  # kept blocks whose backward has not run yet
        self._inside: int | None = None  # the block the engine runs now, its tensors in place
        self._gathered: set[int] = set()  # blocks a GatheredParameters holds in
        # Writes a block's weights (and their fp32 masters) back to the tiers: the engine's.
        self._write_weights = write_weights
        self._prefix = prefix
        self._views = True  # state_dict() gives the blocks' values (off for the engine's own)

        # Each block's tensors' shapes and dtypes as stored: what its placeholders report.
        self._shapes: list[dict[str, tuple[torch.Size, torch.dtype]]] = [{} for _ in self.blocks]

        def registered(i: int) -> None:
            block = self.blocks[i]
            self._shapes[i] = {n: (t.shape, t.dtype) for n, t in block.state_dict().items()}
            self._dematerialize(i)
            block.forward = _OffloadedForward(self, i, type(block).forward.__get__(block))
            block._register_state_dict_hook(functools.partial(_block_values, self, i))

        store.register_layers(self.blocks, prepare=None if prepare is None else
                              (lambda i: prepare(i, self.blocks[i])), done=registered)
        count = len(self.blocks)  # a step loads every block forward, then backward
        store.set_access_order(list(range(count)) + list(range(count - 1, -1, -1)))

    # ---- one block ---------------------------------------------------------------------

    def _materialize(self, index: int) -> None:
        recorder = self.store.recording()
        if recorder is None:
            self.before_use(index)
        else:  # waiting for the block's update is not compute
            start = time.perf_counter()
            self.before_use(index)
            recorder.waited(time.perf_counter() - start)
        for name, tensor in self.store.ensure_layer(index).items():
            _set_tensor(self.blocks[index], name, tensor)

    def _dematerialize(self, index: int) -> None:
        """Block `index`'s tensors back to placeholders (its bytes stay in the tiers)."""
        if index in self._gathered:
            return  # a GatheredParameters holds it in until its end
        block = self.blocks[index]
        for name in self._names[index]:
            owner_name, _, leaf = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            shape, dtype = self._shapes[index][name]
            empty = torch.empty(0, dtype=dtype, device=self.store.device)
            if leaf in owner._parameters:
                park(owner._parameters[leaf], f"{self._prefix}{self.positions[index]}.{name}",
                     shape, self, empty)
            else:
                owner._buffers[leaf] = empty

    @contextlib.contextmanager
    def _running(self, index: int):
        """Calls of block `index` in the body run its own forward (the engine's call)."""
        self._inside = index
        try:
            yield
        finally:
            self._inside = None

    @contextlib.contextmanager
    def _using(self, index: int, step: int):
        """Block `index` on the device for the body, prefetching the next blocks in
        direction `step` behind it (as deep as the store's plan says).

        The block comes first: prefetches must never take the budget it needs. After an
        error no layer, prefetched or not, stays on the device.
        """
        self._materialize(index)
        self.store.prefetch_ahead(index, step, ready=self.ready_for_use)
        try:
            yield self.blocks[index]
        except BaseException:
            for i in self.store.resident_layers():
                self.store.release_layer(i)
            raise
        finally:
            self._dematerialize(index)
            self.store.release_layer(index)

    def _forward_block(self, index: int, x: torch.Tensor, extra: tuple) -> torch.Tensor:
        args, kwargs = extra
        with self._using(index, 1) as block, self._running(index):
            return block(x, *args, **kwargs)

    def _forward_kept(self, index: int, x: torch.Tensor, extra: tuple):
        """Block `index` forward with its graph kept: (its detached input, its output)."""
        args, kwargs = extra
        self._materialize(index)
        self._kept_live.add(index)
        self.store.prefetch_ahead(index, 1, ready=self.ready_for_use)
        try:
            with torch.enable_grad(), self._running(index):
                x_in = x.detach().requires_grad_(x.requires_grad)
                out = self.blocks[index](x_in, *args, **kwargs)
            recorder = self.store.recording()
            if recorder is not None:  # its forward ends here; it stays on the device
                recorder.computed(index)
            return x_in, out
        except BaseException:
            self._kept_live.discard(index)
            self._dematerialize(index)
            for i in self.store.resident_layers():
                self.store.release_layer(i)
            raise

    def _backward_kept(self, index: int, x_in: torch.Tensor, out: torch.Tensor,
                       grad_out: torch.Tensor) -> torch.Tensor | None:
        """Run the kept graph of block `index`, store its gradients, let its tensors go."""
        recorder = self.store.recording()
        if recorder is not None:  # its backward: a use without a load
            recorder.used(index)
        self.store.prefetch_ahead(index, -1, ready=self.ready_for_use)  # earlier blocks may need loading
        try:
            block = self.blocks[index]
            named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
            inputs = ([x_in] if x_in.requires_grad else []) + [p for _, p in named]
            grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            grad_in = grads[0] if x_in.requires_grad else None
            self._store_gradients(index, named, grads[1:] if x_in.requires_grad else grads,
                                  grad_out.device)
            return grad_in
        except BaseException:
            for i in self.store.resident_layers():
                if i != index:
                    self.store.release_layer(i)
            raise
        finally:
            self._kept_live.discard(index)
            self._dematerialize(index)
            self.store.release_layer(index)

    def start_probe(self, input_limit: int) -> None:
        """Measure the next forward and backward (the placement's probe), keeping block
        inputs on the device if all of them fit within `input_limit` bytes held there."""
        self.measure_activations = True
        self.probe_input_limit = input_limit
        self.probe_stashed_bytes = 0
        self._probe_keeps = None

    def probe_input_tier(self, index: int, x: torch.Tensor) -> str | None:
        """Where the probe keeps block `index`'s input: on the device (None) or with the tier
        manager (AUTO). All inputs or none, decided at the first from what the device holds
        (its allocator's figure; a CPU "device" has none to ask) and that input's size
        times the blocks from it on. Some kept and the rest sent out is the wrong middle:
        the backward's first recompute comes on top of every kept input (a 7B block at 32k
        tokens saves about 9 GB), and a probe that kept half a 16 GiB budget of inputs ran
        out of memory there on the H200."""
        nbytes = x.numel() * x.element_size()
        if self._probe_keeps is None:
            held = torch.cuda.memory_allocated(x.device) if x.is_cuda else 0
            inputs = nbytes * (len(self.blocks) - index)
            self._probe_keeps = held + inputs <= self.probe_input_limit
        if self._probe_keeps:
            return None
        self.probe_stashed_bytes += nbytes
        return AUTO

    def policy(self, index: int) -> str:
        """Block `index`'s activation policy now: keep, recompute, or where its input waits."""
        if self.keep_activations[index]:
            return "keep"
        return self.input_tiers[index] or "recompute"

    def release_kept(self) -> None:
        """Let go of kept blocks whose backward never ran (a forward without a backward),
        and of inputs stored for such a backward."""
        self.stash.clear()
        for index in sorted(self._kept_live):
            self._dematerialize(index)
            self.store.release_layer(index)
        self._kept_live.clear()

    def new_gradients(self) -> None:
        """Start a new accumulation window: the next backward overwrites, later ones add."""
        self.wait_for_gradients()
        self._generation += 1

    def has_gradients(self, index: int) -> bool:
        return self._grad_generation[index] == self._generation

    def _backward_block(self, index: int, x: torch.Tensor, extra: tuple,
                        grad_out: torch.Tensor, replay: "_ReplayState") -> torch.Tensor | None:
        args, kwargs = extra
        with self._using(index, -1) as block, self._running(index):
            with torch.enable_grad(), replay.replaying():
                x_in = x.detach().requires_grad_(x.requires_grad)
                if self.measure_activations:
                    own = tuple(t.untyped_storage().data_ptr() for t in block.state_dict().values())
                    with SavedBytes(exclude=own) as saved:
                        out = block(x_in, *args, **kwargs)
                    self.activation_bytes[index] = saved.bytes
                    self.input_bytes[index] = x.numel() * x.element_size()
                else:
                    out = block(x_in, *args, **kwargs)
                named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
                inputs = ([x_in] if x.requires_grad else []) + [p for _, p in named]
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            grad_in = grads[0] if x.requires_grad else None
            self._store_gradients(index, named, grads[1:] if x.requires_grad else grads, x.device)
            return grad_in

    def _store_gradients(self, index: int, named: list, param_grads, device) -> None:
        """Write block `index`'s parameter gradients to the tier manager (added to the
        window's earlier ones), then tell `on_gradients`."""
        if self.measure_activations:
            return  # the placement's probe: its gradients are thrown away, never stored
        new = {f"{n}.grad": (g if g is not None else torch.zeros_like(p))
               for (n, p), g in zip(named, param_grads)}
        if self.has_gradients(index):  # accumulate within the window
            self.wait_for_gradients(index)
            for key, old in self.store.read_layer(index, "grad").items():
                new[key] = new[key] + old.to(new[key].device)
        if self.track_grad_norms:
            self.grad_sq_norms[index] = sum((squared_norm(g) for g in new.values()),
                                            torch.zeros((), device=device))
        self._grad_generation[index] = self._generation
        if self.gradient_writes is not None:  # behind the backward (worker/engine/gradient_writes.py)
            self.gradient_writes.submit(index, new, then=self.on_gradients)
            return
        self.store.write_back(index, new, kind="grad", durable=False)
        if self.on_gradients is not None:
            self.on_gradients(index)

    def wait_for_gradients(self, index: int | None = None) -> None:
        """Block `index`'s gradients (every block's: None) are stored with the tier manager."""
        if self.gradient_writes is not None:
            self.gradient_writes.wait(index) if index is not None else self.gradient_writes.flush()

    def offloaded(self) -> list[int]:
        """The blocks that still live with the tier manager (not made resident)."""
        return [i for i in range(len(self.blocks)) if i not in self.resident]

    def make_resident(self, index: int, device_tensors: dict[str, torch.Tensor],
                      recompute: bool = False) -> torch.nn.Module:
        """Make block `index` an ordinary module of the model again, its tensors the given
        device tensors (the caller read them from the tier manager): from now on it is
        never loaded. With `recompute` its forward runs under activation checkpointing
        (torch.utils.checkpoint: only its input is kept), else autograd keeps its
        activations. The caller moves its optimizer state and deletes its keys."""
        if index in self.resident:
            raise InvalidArgumentError(f"block {index} is resident already")
        block = self.blocks[index]
        for name in self._names[index]:
            _set_tensor(block, name, device_tensors[name])
        # An instance attribute either way: the module's names (state dict, export) stay its own.
        original = type(block).forward.__get__(block)
        block.forward = functools.partial(_checkpointed, original) if recompute else original
        self.resident.add(index)
        self.keep_activations[index] = not recompute
        return block

    # ---- views: what a user's code reads and changes of an offloaded block ---------------

    @contextlib.contextmanager
    def engine_state_dict(self):
        """model.state_dict() in the body leaves the offloaded blocks' placeholders as they
        are (the engine's checkpoint saves the blocks from the tiers itself)."""
        self._views, before = False, self._views
        try:
            yield
        finally:
            self._views = before

    def gather(self, params: list[torch.nn.Parameter]) -> None:
        """Bring the blocks of `params` in (every parameter of each), for the user's code
        (GatheredParameters): on this device, their stored values, once updated."""
        for index in sorted({self._index_of(p) for p in params}):
            if index in self._gathered or index in self.resident:
                continue
            for name, tensor in self.parameters_of(index).items():
                _set_tensor(self.blocks[index], name, tensor.to(self.store.device))
            self._gathered.add(index)

    def release(self, params: list[torch.nn.Parameter], modified: bool) -> None:
        """Park the blocks of `params` again; with `modified`, store their weights as they
        are now (and their masters: the engine's `write_weights`)."""
        for index in sorted({self._index_of(p) for p in params}):
            if index not in self._gathered:
                continue
            if modified:
                weights = {name: t.detach() for name, t in self.blocks[index].state_dict().items()}
                if self._write_weights is not None:
                    self._write_weights(index, weights)
                else:
                    self.store.write_back(index, weights)
            self._gathered.discard(index)
            self._dematerialize(index)

    def _index_of(self, param: torch.nn.Parameter) -> int:
        for index, block in enumerate(self.blocks):
            if any(p is param for p in block.parameters()):
                return index
        raise InvalidArgumentError("the parameter is not one of this engine's offloaded blocks'")

    def trainable(self, index: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Block `index`'s parameters that get gradients: (name, shape, dtype), in the order
        its gradients are stored."""
        layout = {s.name: s for s in self.store.layout(index).slots}
        return [(n, layout[n].shape, dtype_from_name(layout[n].dtype))
                for n, p in self.blocks[index].named_parameters() if p.requires_grad]

    def gradients(self, index: int) -> dict[str, torch.Tensor]:
        """Block `index`'s parameter gradients of the current window (CPU copies)."""
        if not self.has_gradients(index):
            raise InvalidArgumentError(
                f"block {index} has no gradients since the last zero_grad: run a backward "
                f"through it before the optimizer step")
        self.wait_for_gradients(index)
        return {k[:-len(".grad")]: v for k, v in self.store.read_layer(index, "grad").items()}

    def parameters_of(self, index: int) -> dict[str, torch.Tensor]:
        """Block `index`'s stored tensors (CPU copies), once its update is done."""
        self.before_use(index)
        return self.store.read_layer(index)


def _block_values(blocks: OffloadedBlocks, index: int, module: torch.nn.Module, state_dict: dict,
                  prefix: str, local_metadata: dict) -> None:
    """A state_dict hook of offloaded block `index`: its entries get their real values,
    read from the tiers (CPU copies; one block in memory at a time while the dict is
    made), unless the block is in use, gathered or resident (its tensors are real then)."""
    if not blocks._views or index in blocks.resident or index in blocks._gathered \
            or blocks._inside == index:
        return
    values = blocks.parameters_of(index)
    for name in blocks._names[index]:
        if prefix + name in state_dict:
            state_dict[prefix + name] = values[name]


def _checkpointed(forward: Callable, *args, **kwargs):
    """A resident block's forward with only its input kept for backward (recomputed there)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _check_supported(index: int, block: torch.nn.Module) -> None:
    """Refuse blocks whose offloaded copy would silently train differently."""
    seen: dict[int, str] = {}
    parked: dict[int, str] = {}
    for name, tensor in block.state_dict(keep_vars=True).items():
        if is_parked(tensor):  # built under zero.Init: its bytes wait elsewhere, its object is it
            if id(tensor) in parked:
                raise InvalidArgumentError(
                    f"block {index}: {name!r} is the same parameter as {parked[id(tensor)]!r}; "
                    f"weights tied inside a block are not supported yet (tie across blocks or "
                    f"keep the tied module out of the offloaded list)")
            parked[id(tensor)] = name
            continue
        if tensor.is_meta:  # created later, one block at a time: nothing is shared yet
            continue
        if tensor.numel() and tensor.data_ptr() in seen:
            raise InvalidArgumentError(
                f"block {index}: {name!r} shares its storage with {seen[tensor.data_ptr()]!r}; "
                f"weights tied inside a block are not supported yet (tie across blocks or "
                f"keep the tied module out of the offloaded list)")
        seen[tensor.data_ptr()] = name
    for name, module in block.named_modules():
        if getattr(module, "track_running_stats", False) and getattr(module, "running_mean", None) is not None:
            raise InvalidArgumentError(
                f"block {index}: {name or type(module).__name__} updates running statistics in "
                f"place, which an offloaded block would lose; use LayerNorm/RMSNorm, or "
                f"track_running_stats=False")
