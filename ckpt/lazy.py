"""Public names imported on first use (PEP 562): a package's ``import`` costs nothing until one of its names is
used, so ``ckpt --help``, ``ls`` and ``inspect`` never load torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str], cache: dict[str, Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` resolving ``table`` (public name -> submodule, relative to
    ``package``); with ``cache`` (the package's ``globals()``) a resolved name is stored there, so later look-ups
    skip the function."""

    def getattr_(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        if cache is not None:
            cache[name] = value
        return value

    return getattr_
