"""The one place that finds and loads the tier manager's compiled C libraries.

Each file of native/ (blockio.c: the NVMe IO loop; adamw.c: the AdamW kernel) is a plain
C library loaded with ctypes: it uses no Python API, so one build serves every Python
version. `pip install` builds each as an optional extension module (setup.py); where
pip cannot run, deploy/device_env.sh compiles them by hand into native/. A library that
is not there, or does not load, gives None, and its user falls back to a slower path
and says so.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def load_native_library(name: str) -> ctypes.CDLL | None:
    """native/<name>.c compiled, or None.

    Looked for at $TIERSTACK_<NAME>_LIB, then as the extension module
    tierstack.services.tier_manager._<name> that `pip install` builds, then as
    native/libtierstack_<name>.so (built by hand: see the file's header).
    """
    candidates = [os.environ.get(f"TIERSTACK_{name.upper()}_LIB", "")]
    try:
        spec = importlib.util.find_spec(f"tierstack.services.tier_manager._{name}")
        candidates.append(spec.origin if spec and spec.origin else "")
    except (ImportError, ValueError):
        pass
    candidates.append(str(Path(__file__).parent / "native" / f"libtierstack_{name}.so"))
    for path in filter(None, candidates):
        if not os.path.exists(path):
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            log.warning("cannot load the native %s library %s: %s", name, path, e)
    return None
