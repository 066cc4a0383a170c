"""The optional parts of tierstack and the pip extra that brings each: a command that needs
one it lacks says, in one line, what to install (`require`), instead of a traceback from
an import deep inside it.

    pip install tierstack            the engine, the tier manager, the scheduler, initialize
    pip install 'tierstack[hf]'      + the Hugging Face Trainer integration (transformers, accelerate)
    pip install 'tierstack[cluster]' + Ray clusters and partitioned training over Ray actors,
                                       the cluster's TLS secrets (ray, cryptography)
"""

from __future__ import annotations

import importlib.util

from tierstack.errors import MissingExtraError

EXTRAS = {"hf": ("transformers", "accelerate"), "cluster": ("ray", "cryptography")}
"""Each extra of pyproject.toml's optional-dependencies -> the modules it brings."""


def require(extra: str, what: str) -> None:
    """Refuse in one line naming `extra` when one of its modules is not installed; `what`
    says what needs it (e.g. 'tierstack train --ranks')."""
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{what} needs {' and '.join(missing)}, which this Python does not "
                                f"have: pip install 'tierstack[{extra}]'")
