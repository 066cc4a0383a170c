"""`import tierstack as deepspeed`, then `from deepspeed.accelerator import ...`: the module half.

An alias binds one name in one namespace; an import statement looks modules up by their
full name, so after `import tierstack as deepspeed` the lines

    from deepspeed.accelerator import get_accelerator
    import deepspeed.comm as dist
    from deepspeed.ops.adam import DeepSpeedCPUAdam

would look for a package named `deepspeed` and fail (or find DeepSpeed itself). The finder
here, put first on sys.meta_path when tierstack is imported, answers `deepspeed` and
`deepspeed.<name>` with tierstack's module of that name (tierstack.accelerator, .comm,
.ops.adam, ...) for code whose namespace binds `deepspeed` to tierstack: the script that
changed its import. Everyone else (transformers and accelerate probing whether DeepSpeed
is installed, DeepSpeed itself where it is) is answered as if the finder were not there,
until the script has imported through the alias: the import system then keeps the
answer under `deepspeed` in sys.modules for the whole process, as for any module.

A `deepspeed.<name>` that tierstack does not provide is a ModuleNotFoundError that says
so and names the alternative (tierstack/__init__.py's NOT_PROVIDED).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

ALIAS = "deepspeed"


class _AliasLoader(importlib.abc.Loader):
    """Hands out tierstack's module as `deepspeed.<name>` (the module itself, not a copy)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Imported already, under its own name; the import system has just set the alias's
        # spec on it: give it back its own (importlib.util.find_spec("tierstack") reads it).
        module.__spec__ = self.own_spec


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    """Finds `deepspeed[.X]` as `tierstack[.X]` for code that aliased tierstack as deepspeed."""

    def __init__(self, package: ModuleType, not_provided) -> None:
        self.package = package
        self.not_provided = not_provided  # name -> the one-line reason and alternative, or None

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        if sys.modules.get(ALIAS) is not self.package and not self._asked_by_alias():
            return None
        mapped = self.package.__name__ + fullname[len(ALIAS):]
        if importlib.util.find_spec(mapped) is None:
            name = fullname[len(ALIAS) + 1:]
            raise ModuleNotFoundError(self.not_provided(name) or
                                      f"tierstack does not provide {fullname} (no {mapped})",
                                      name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(mapped),
                                              is_package=fullname == ALIAS)

    def _asked_by_alias(self) -> bool:
        """Whether the code importing binds `deepspeed` to tierstack (locals or globals)."""
        frame = sys._getframe(2)
        while frame is not None and _is_import_machinery(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return False
        return (frame.f_locals.get(ALIAS) is self.package
                or frame.f_globals.get(ALIAS) is self.package)


_IMPORTLIB = os.path.dirname(importlib.__file__) + os.sep


def _is_import_machinery(filename: str) -> bool:
    """importlib's frames (frozen or not: import_module, util.find_spec) and this finder's."""
    return (filename.startswith("<frozen importlib") or filename.startswith(_IMPORTLIB)
            or filename == __file__)


def install(package: ModuleType, not_provided) -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, DeepSpeedAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAlias(package, not_provided))
