"""Lightning's checkpoint dict as ckpt's format and back, without Lightning imported and without pickle.

``Trainer.save_checkpoint`` hands its ``CheckpointIO`` one dict: ``state_dict`` (the LightningModule's tensors),
``optimizer_states`` (one ``torch.optim`` state dict per optimizer: parameters are *numbered*), and everything
else small (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``, ``hyper_parameters``,
``pytorch-lightning_version``, ...).

How each part is stored:

- ``state_dict`` tensors are the checkpoint's model tensors, under their own names;
- each optimizer moment (a tensor of one or more dimensions) is an ``optimizer_state`` tensor named
  ``optim/<k>.<index>/<key>``: optimizer ``k``, parameter number ``index``; the file does not say which model
  tensor that number is (Lightning numbers what the user handed the optimizer), so no name is guessed for it;
- everything else, the optimizers' scalar state and param_groups included, is one treecodec tree in the
  manifest's ``extra.lightning`` (JSON: reading it back executes nothing), with what JSON cannot say on its own:
  the order of ``state_dict``'s keys and of each parameter's state keys, which dicts were Lightning's
  ``AttributeDict`` (``hyper_parameters``), and (``prefix``) the module prefix a conversion with ``--config`` took
  off the model's tensors.

:func:`split` and :func:`join` are inverses: ``join(*split(d))`` equals ``d``, tensor for tensor and type for type.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckpt.errors import ManifestError
from ckpt.format import treecodec
from ckpt.state.training import NamedTensor, optim_name

#: the manifest's ``extra`` key holding Lightning's non-tensor state
EXTRA_KEY = "lightning"
MODEL_KEY = "state_dict"
OPTIMIZERS_KEY = "optimizer_states"
#: Lightning's ``AttributeDict`` classes (``hyper_parameters`` is one): a dict stored as the tree's dict and
#: restored as its own class, named by module and class
ATTRIBUTE_DICTS = {
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning.fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
}


def _class_path(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _param(k: int, index: Any) -> str:
    return f"{k}.{index}"


def split(checkpoint: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[NamedTensor], dict[str, Any]]:
    """``(model tensors, optimizer moment tensors, extra.lightning tree)`` of Lightning's checkpoint dict.

    Raises :class:`~ckpt.errors.ManifestError` naming the entry when something is neither a tensor nor a value the
    tree can hold (an object in ``hyper_parameters``): refused at the save, not lost."""
    sd = checkpoint.get(MODEL_KEY) or {}
    model = {str(n): t for n, t in sd.items() if isinstance(t, torch.Tensor)}
    other_model = {n: v for n, v in sd.items() if not isinstance(v, torch.Tensor)}
    moments: list[NamedTensor] = []
    optimizers = []
    for k, opt in enumerate(checkpoint.get(OPTIMIZERS_KEY) or []):
        state: dict[Any, Any] = {}
        orders = []
        for index, per in opt.get("state", {}).items():
            small = {}
            for key, value in per.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    moments.append(
                        NamedTensor(optim_name(_param(k, index), key), value, "optimizer_state", _param(k, index), key)
                    )
                else:
                    small[key] = value
            state[index] = small
            orders.append([index, list(per)])
        optimizers.append({**{n: v for n, v in opt.items() if n != "state"}, "state": state, "order": orders})
    rest = {n: v for n, v in checkpoint.items() if n not in (MODEL_KEY, OPTIMIZERS_KEY)}
    tree = {
        "checkpoint": treecodec.encode(rest, "checkpoint"),
        "has": [n for n in (MODEL_KEY, OPTIMIZERS_KEY) if n in checkpoint],
        "order": list(map(str, sd)),
        "model_other": treecodec.encode(other_model, "state_dict"),
        "optimizers": treecodec.encode(optimizers, "optimizer_states"),
        "attribute_dicts": {n: _class_path(v) for n, v in rest.items() if _class_path(v) in ATTRIBUTE_DICTS},
    }
    return model, moments, tree


def optimizer_tree(moments: list[NamedTensor], tree: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``optimizer`` object for the moments :func:`split` made: their parameters by group (the
    full state, exactly, is in ``extra.lightning``)."""
    groups = []
    for k, opt in enumerate(treecodec.decode(tree["optimizers"])):
        for g in opt.get("param_groups", []):
            enc = {n: treecodec.encode(v, f"param_groups.{n}") for n, v in g.items() if n != "params"}
            groups.append({**enc, "params": [_param(k, i) for i in g.get("params", [])]})
    return {"type": "lightning.optimizer_states", "param_groups": groups, "state": {}}


def join(read: Callable[[str], torch.Tensor], names: list[str], tree: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict from ``extra.lightning`` and the tensors ``read(name)`` gives.

    ``names``: the checkpoint's tensor names (a moment the tree expects and the checkpoint lacks is refused)."""
    try:
        checkpoint = treecodec.decode(tree["checkpoint"])
        has, order = tree["has"], tree["order"]
        optimizers = treecodec.decode(tree["optimizers"])
        model_other = treecodec.decode(tree["model_other"])
    except (KeyError, TypeError) as exc:
        raise ManifestError(f"extra.{EXTRA_KEY}: not a Lightning checkpoint record (missing {exc})") from None
    present = set(names)
    prefix = tree.get("prefix") or ""  # a converter stored the HF model's tensors without the module's prefix
    if MODEL_KEY in has:
        sd: OrderedDict[str, Any] = OrderedDict()
        for n in order:
            stored = n[len(prefix) :] if prefix and n.startswith(prefix) else n
            sd[n] = model_other[n] if n in model_other else read(stored)
        checkpoint[MODEL_KEY] = sd
    if OPTIMIZERS_KEY in has:
        states = []
        for k, opt in enumerate(optimizers):
            small = opt.pop("state")
            state = {}
            for index, keys in opt.pop("order"):
                per = {}
                for key in keys:
                    if key in small[index]:
                        per[key] = small[index][key]
                        continue
                    name = optim_name(_param(k, index), key)
                    if name not in present:
                        raise ManifestError(f"extra.{EXTRA_KEY}: optimizer {k} state {name!r} is not in the checkpoint")
                    per[key] = read(name)
                state[index] = per
            states.append({**opt, "state": state})
        # the keys in the order Lightning wrote them: state first, then param_groups
        checkpoint[OPTIMIZERS_KEY] = [{"state": s.pop("state"), **s} for s in states]
    for n, path in (tree.get("attribute_dicts") or {}).items():
        if path not in ATTRIBUTE_DICTS:
            raise ManifestError(f"extra.{EXTRA_KEY}.attribute_dicts: {n} names {path!r}, not a Lightning AttributeDict")
        import importlib

        module, _, cls = path.rpartition(".")
        checkpoint[n] = getattr(importlib.import_module(module), cls)(checkpoint[n])
    return checkpoint


__all__ = ["ATTRIBUTE_DICTS", "EXTRA_KEY", "join", "optimizer_tree", "split"]
