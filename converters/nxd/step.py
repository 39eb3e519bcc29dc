"""The step an NxD tag stands for, read from its contents (the tag's name is only a name).

NxD records no step field.  By convention the training script puts ``total_steps`` into ``user_content.pt``; a
scheduler stepped once per optimizer step has ``last_epoch`` equal to the step.  A tag's name is whatever the user
typed (``llama_v7``, ``tp4``, a renamed or copied ``run7``): digits in it are not a step, so a tag whose files name
none has an unknown step (None; ``--step`` supplies it).  So the step is, in order: ``user_content.pt``'s
``total_steps`` (or ``global_step`` / ``step``), ``scheduler.pt``'s ``last_epoch``, and a name only where a
registered *strict* template (:data:`NAME_TEMPLATES`, e.g. a tool's documented tag naming) parses the whole name;
when the sources that exist disagree, a warning names them all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ckpt.errors import CkptError

from .files import TagFiles
from .tagname import name_step as nxdt_name_step
from .xser import load_checked

#: strict tag-name parsers ``name -> step | None`` (None: the name is not in the template), tried in order.  Only a
#: naming that a tool documents as recording the step belongs here (one that parses the *whole* name); the digits of
#: an arbitrary name never do: NxD Training's ``<run>--step=N-consumed_samples=X[-last].ckpt`` (tagname.py).
NAME_TEMPLATES: list[Callable[[str], int | None]] = [nxdt_name_step]


def name_step(name: str) -> tuple[str, int] | None:
    """``(where, step)`` from the first :data:`NAME_TEMPLATES` parser that accepts ``name``, else None."""
    for parse in NAME_TEMPLATES:
        v = parse(name)
        if v is not None:
            return f"tag name {name!r}", v
    return None


#: keys of ``user_content.pt`` that hold the global step, by preference
USER_STEP_KEYS = ("total_steps", "global_step", "step")


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int) and v >= 0:
        return v
    item = getattr(v, "item", None)  # a 0-d tensor
    if item is not None and getattr(v, "numel", lambda: 0)() == 1:
        x = item()
        if isinstance(x, (int, float)) and float(x).is_integer() and x >= 0:
            return int(x)
    return None


def step_sources(
    files: TagFiles, *, verify: bool = True, user_content: Any = None, scheduler: Any = None
) -> list[tuple[str, int]]:
    """``(where, step)`` for every source in the tag that names a step, most trusted first.

    ``user_content`` / ``scheduler``: the already loaded objects (else the files are read).  A file that cannot
    be read is skipped here: whoever reads it for real reports the damage.
    """
    found: list[tuple[str, int]] = []
    user_content = _loaded(user_content, files.user_content, verify)
    if isinstance(user_content, dict):
        for key in USER_STEP_KEYS:
            v = _int(user_content.get(key))
            if v is not None:
                found.append((f"user_content.pt {key}={v}", v))
                break
    scheduler = _loaded(scheduler, files.scheduler, verify)
    if isinstance(scheduler, dict):
        v = _int(scheduler.get("last_epoch"))
        if v is not None:
            found.append((f"scheduler.pt last_epoch={v}", v))
    named = name_step(files.path.name)
    if named is not None:
        found.append(named)
    return found


def _loaded(obj: Any, path: Any, verify: bool) -> Any:
    """``obj`` when already loaded, else the file at ``path`` (None: absent, or damaged, which its reader reports)."""
    if obj is not None or path is None:
        return obj
    try:
        return load_checked(path, verify=verify)
    except CkptError:
        return None


def tag_step(files: TagFiles, *, verify: bool = True, warn: bool = True, **loaded: Any) -> int | None:
    """The tag's step (see the module docstring); None (unknown) when no file, nor a strict name template, records
    one.  Warns when sources disagree."""
    found = step_sources(files, verify=verify, **loaded)
    if not found:
        return None
    step = found[0][1]
    if warn and len({v for _, v in found}) > 1:
        warnings.warn(
            f"{files.path}: sources disagree on the step ({', '.join(w for w, _ in found)}); using {step} from "
            f"{found[0][0].split('=')[0]} (pass --step to choose)",
            stacklevel=3,
        )
    return step
