"""How errors name config keys: the nearest known key for one mistyped (`suggest`), and the
key the user wrote behind one tierstack translated (`UserKeys`).

The bottom of the config's modules: the loader (tierstack/config.py), the DeepSpeed
translation (tierstack/deepspeed_config.py) and the learning-rate schedules
(tierstack/lr_schedules.py) all name keys in their errors, and import this, never each
other the other way (pyproject.toml's import contracts keep the arrows one way).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from tierstack.errors import TierstackError


def suggest(key: str, known, where: str = "") -> str:
    """'did you mean X?' for the nearest known key (difflib), else the known keys."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {where}{close[0]}?"
    return f"known keys here: {', '.join(sorted(known))}"


# A dotted key in a message: train.params.device, tier_manager.nvme_pool.paths.
_DOTTED_KEY = re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class UserKeys:
    """Each tierstack key a translation made -> the key the user wrote (a DeepSpeed JSON's
    `zero_optimization.offload_param.nvme_path` for `tier_manager.nvme_pool.paths`). Empty
    for tierstack's own config, whose keys are the user's."""

    names: dict[str, str] = field(default_factory=dict)

    def of(self, key: str) -> str:
        """`key` as the user wrote it: the longest translated prefix renamed, else `key`."""
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in self.names:
                return self.names[prefix] + key[len(prefix):]
        return key

    def of_item(self, key: str, index: int) -> str:
        """How the user wrote item `index` of list `key` (one DeepSpeed nvme_path of the
        NVMe pool's paths), else `key` as `of` names it."""
        return self.names.get(f"{key}[{index}]") or self.of(key)

    def in_message(self, message: str) -> str:
        """`message` with every translated key in it named as the user wrote it."""
        if not self.names:
            return message
        return _DOTTED_KEY.sub(lambda match: self.of(match.group(0)), message)

    def rename(self, error: TierstackError) -> TierstackError:
        """`error` (the same object: its type and traceback kept) with its message in the
        user's keys."""
        if self.names and error.args and isinstance(error.args[0], str):
            error.args = (self.in_message(error.args[0]), *error.args[1:])
        return error
