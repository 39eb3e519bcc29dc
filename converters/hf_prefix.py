"""Which attribute path of a training framework's module holds the Hugging Face model a ``config.json`` describes
(``self.model = AutoModelForCausalLM...`` in a LightningModule: ``model.``), so a conversion with ``--config``
writes the model's own names.  Shared by the Lightning ``.ckpt`` and DeepSpeed folder sources."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt.errors import LayoutError


def _config_names(config: Mapping[str, Any]) -> set[str] | None:
    """The tensor names of the HF model ``config`` describes (built on the ``meta`` device: no memory), or None
    when transformers cannot build it."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    return set(model.state_dict())


def model_prefix(names: set[str], config: Mapping[str, Any], where: str) -> str:
    """The attribute path under which the LightningModule holds the HF model ``config`` describes (``"model."`` for
    ``self.model = AutoModelForCausalLM...``; ``""`` when the names are the model's own).  Checked against every
    tensor the config's model has; a state_dict that holds it under no single prefix is refused, never guessed."""
    expected = _config_names(config)
    if expected is None or expected <= names:
        return ""
    probe = min(expected)
    fits = sorted(
        p
        for p in {n[: len(n) - len(probe)] for n in names if n.endswith("." + probe)}
        if all(p + e in names for e in expected)
    )
    if len(fits) != 1:
        missing = sorted(expected - names)[:2]
        raise LayoutError(
            f"{where}: the state_dict holds the model config.json describes under "
            + (f"{len(fits)} prefixes ({', '.join(fits)})" if fits else f"no prefix (no tensor ends with {missing})")
            + "; cannot tell which tensors are the model"
        )
    return fits[0]


__all__ = ["model_prefix"]
