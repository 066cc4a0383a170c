"""A timeline of where a run's disk time goes, from inside every tierstack process of it.

With this directory on PYTHONPATH and TS_TRACE_DIR set, each Python process of the run
(the bench, its training child, the tier-manager daemon) wraps, as the modules load:
every NVMe batch (IoEngine.read / write: bytes, requests), every file sync, the streamed
AdamW's phases per block (acquire on the reader thread, update on the compute thread,
which does a streamed block's IO, finish on the writer thread), and on the worker side
ensure_layer, the fetches behind it, the AdamW requests and the training steps, the
placement, initialize, Hugging Face's Trainer.train and the daemon's first making of its
AdamW stepper. With TS_SAMPLE_MS set too,
every thread's stack is sampled that often ("sample" events: the innermost frames), to
see where a span no wrapper names went (samples.py reads them). Each
event is one JSON line {k, t0, t1, th, ...} in TS_TRACE_DIR/trace-<pid>.jsonl, times in
time.perf_counter seconds (CLOCK_MONOTONIC: comparable across the processes of one
machine), written every 0.5 s by a thread of its own. A diagnostic, not a metric: it
wraps private methods, so it follows their names; summarize.py reads the files.

  TS_TRACE_DIR=/tmp/tr PYTHONPATH=bench/timeline:$PYTHONPATH \
      python3 bench/vs_deepspeed.py --modes nvme --sides ts --steps 4 --nvme-dir /var/tmp/vsds
  python3 bench/timeline/summarize.py /tmp/tr
Used for docs/bench/vs_deepspeed_h200_stream_tiles.txt (issue 12 item 5).
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time

DIR = os.environ.get("TS_TRACE_DIR")
_lock = threading.Lock()
_buf: list[dict] = []


def _emit(kind, t0, t1, **kw):
    with _lock:
        _buf.append({"k": kind, "t0": round(t0, 5), "t1": round(t1, 5),
                     "th": threading.current_thread().name, **kw})


def _flush():
    global _buf
    with _lock:
        out, _buf = _buf, []
    if out:
        with open(os.path.join(DIR, f"trace-{os.getpid()}.jsonl"), "a") as f:
            for e in out:
                f.write(json.dumps(e) + "\n")


def _flusher():
    while True:
        time.sleep(0.5)
        _flush()


def _wrap(cls, name, kind, describe):
    fn = getattr(cls, name)

    def wrapped(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            try:
                extra = describe(*a, **kw)
            except Exception as e:  # noqa
                extra = {"err": repr(e)}
            _emit(kind, t0, time.perf_counter(), **extra)
    setattr(cls, name, wrapped)


def _nbytes(self, requests, *a, **kw):
    return {"b": sum(r.length for r in requests), "n": len(requests)}


PATCHES = {
    "tierstack.services.tier_manager.io_engine": lambda m: (
        _wrap(m.IoEngine, "read", "io_r", _nbytes), _wrap(m.IoEngine, "write", "io_w", _nbytes),
        _wrap(m.DirectFile, "sync", "sync", lambda self, *a, **k: {})),
    "tierstack.services.tier_manager.adamw": lambda m: (
        _wrap(m.AdamWStepper, "_acquire", "acq", lambda self, block, hyper: {"key": block.params}),
        _wrap(m.AdamWStepper, "_update", "upd", lambda self, held, hyper: {
            "key": held.block.params,
            "streamed": sorted(n for n, s in held.sources.items() if isinstance(s, m.StreamedTensor))}),
        _wrap(m.AdamWStepper, "_give_back", "fin", lambda self, held, *a, **k: {"key": held.block.params}),
        _wrap(m.AdamWStepper, "step", "step", lambda self, blocks, *a, **k: {"keys": [b.params for b in blocks]})),
    "tierstack.worker.store.layer_store": lambda m: (
        _wrap(m.LayerStore, "ensure_layer", "ensure", lambda self, i, *a, **k: {"i": i}),
        _wrap(m.LayerStore, "_fetch", "fetch", lambda self, key, n, *a, **k: {"key": key, "b": n})),
    "tierstack.worker.engine.tiered_adamw": lambda m: (
        _wrap(m.TieredAdamW, "_run", "run", lambda self, idx, *a, **k: {"i": idx}),),
    "tierstack.worker.engine.offload_engine": lambda m: (
        _wrap(m.OffloadEngine, "train_step", "train_step", lambda self, *a, **k: {}),
        _wrap(m.OffloadEngine, "place_with", "place", lambda self, *a, **k: {}),
        _wrap(m.OffloadEngine, "_store_deferred_masters", "masters", lambda self, *a, **k: {}),
        _wrap(m.OffloadEngine, "backward", "backward", lambda self, *a, **k: {}),
        _wrap(m.OffloadEngine, "step", "opt_step", lambda self, *a, **k: {})),
    "tierstack.worker.api.initialize": lambda m: (
        _wrap(m, "initialize", "init", lambda *a, **k: {}),),
    # Hugging Face's train(): its train_runtime is this span's (tierstack's Trainer inherits it).
    "transformers.trainer": lambda m: (
        _wrap(m.Trainer, "train", "hf_train", lambda self, *a, **k: {}),),
    "tierstack.services.tier_manager.server": lambda m: (
        _wrap(m.TierManagerServicer, "_stepper", "stepper", lambda self, *a, **k: {}),),
}


def _sampler(interval: float) -> None:
    """Every `interval` seconds, each other thread's innermost frames (file:line function)."""
    me = threading.get_ident()
    while True:
        time.sleep(interval)
        now = time.perf_counter()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack = []
            while frame is not None and len(stack) < 8:
                code = frame.f_code
                stack.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            with _lock:
                _buf.append({"k": "sample", "t0": round(now, 4), "t1": round(now, 4),
                             "th": names.get(ident, str(ident)), "stack": stack})


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        orig = loader.exec_module

        def exec_module(module):
            orig(module)
            try:
                PATCHES[name](module)
            except Exception as e:  # noqa
                print(f"trace patch {name} failed: {e!r}", file=sys.stderr)
        loader.exec_module = exec_module
        return spec


if DIR:
    os.makedirs(DIR, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_flusher, daemon=True, name="ts-trace").start()
    if os.environ.get("TS_SAMPLE_MS"):
        threading.Thread(target=_sampler, args=(float(os.environ["TS_SAMPLE_MS"]) / 1000,),
                         daemon=True, name="ts-sample").start()
    atexit.register(_flush)
