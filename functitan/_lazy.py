"""Names a package exports from its torch-using modules, imported on first use.

``functitan train --nproc N`` parses and checks its config, then starts torchrun: that process needs the
config dataclasses of data, elastic and pipeline but never torch, whose import (about 3 s) would sit on the
path of every launch, as would ``functitan pipeline show``'s. A package lists such names here beside its
``TYPE_CHECKING`` imports (what type checkers and the API docs read); everything else it imports as usual.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``modules`` maps a submodule (``"._executor"``) to its names."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(sys.modules[package], name, value)  # once: later lookups are plain attribute reads
        return value

    return __getattr__
