"""The JSON objects a conversion reads beside the tensors (``--config``, a PEFT ``adapter_config.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpt.errors import CkptError


def read_json_object(
    path: Path, shown: str, *, missing: str = "", damaged: type[CkptError] = CkptError
) -> dict[str, Any]:
    """The JSON object in ``path``, or one line starting with ``shown`` that says why not: ``missing`` is added to
    "no such file", and a file that is there but unreadable, not JSON or not an object raises ``damaged``."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CkptError(f"{shown}: no such file{missing}") from None
    except OSError as e:
        raise damaged(f"{shown}: cannot read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(f"{shown}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise damaged(f"{shown}: expected a JSON object, got {type(value).__name__}")
    return value


__all__ = ["read_json_object"]
