"""The allow-list for DeepSpeed's checkpoint pickles (``*_model_states.pt``, ``*_optim_states.pt``), read without
DeepSpeed installed.

Besides tensors and plain containers, DeepSpeed's ZeRO optimizers pickle two kinds of their own objects in
``optimizer_state_dict``: the stage (``deepspeed.runtime.zero.config.ZeroStageEnum``, an ``int`` enum) and the
loss scaler (``deepspeed.runtime.fp16.loss_scaler.LossScaler``: static, also for fp32/bf16 runs;
``DynamicLossScaler``: fp16 with ``loss_scale: 0``), and stages 1/2 their ``param_slice_mappings``
(``deepspeed.utils.tensor_fragment.fragment_address``: two ints).  Each is matched by its pickled name and built as a small
stand-in below, whose ``__setstate__`` accepts only the attributes DeepSpeed's class has, as numbers, bools, None or
a dtype: a crafted file cannot reach anything else through the allowed names.  Any other global (another loss
scaler, a config object, a user class in Lightning's hyper_parameters) is refused by the safe unpickler, naming it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ckpt.safe_unpickle import load_torch_file

ZERO_STAGE_ENUM = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"


class ZeroStage(int):
    """Stand-in for ``ZeroStageEnum``: pickled as ``ZeroStageEnum(<int>)``; only 0..3 are stages."""

    def __new__(cls, value: Any) -> ZeroStage:
        if type(value) is not int or not 0 <= value <= 3:
            raise pickle.UnpicklingError(f"ZeroStageEnum({value!r:.40}) is not a ZeRO stage")
        return super().__new__(cls, value)


class _Scaler:
    """A DeepSpeed object's recorded attributes (a loss scaler's ``cur_scale`` and schedule), nothing callable."""

    #: the attributes DeepSpeed's class pickles (its ``__dict__``)
    fields: frozenset[str] = frozenset()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not set(state) <= self.fields:
            extra = sorted(set(state) - self.fields) if isinstance(state, dict) else type(state).__name__
            raise pickle.UnpicklingError(f"{type(self).__name__} state has unexpected {extra}")
        for k, v in state.items():
            if not (v is None or isinstance(v, (bool, int, float, torch.dtype))):
                raise pickle.UnpicklingError(f"{type(self).__name__}.{k} is a {type(v).__name__}")
        self.__dict__.update(state)

    def record(self) -> dict[str, Any]:
        """The state as JSON-able values (what ``extra.deepspeed`` keeps)."""
        return {k: str(v) if isinstance(v, torch.dtype) else v for k, v in sorted(self.__dict__.items())}


class FragmentAddress(_Scaler):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``param_slice_mappings``: where each
    parameter's piece starts in a rank's stage-1/2 partition, and its length); two ints."""

    fields = frozenset({"numel", "start"})


class LossScaler(_Scaler):
    fields = frozenset({"cur_scale", "dynamic"})


class DynamicLossScaler(_Scaler):
    fields = frozenset(
        {"cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
         "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale", "dtype"}
    )  # fmt: skip


def allowed_globals() -> dict[tuple[str, str], Any]:
    """Lightning's allow-list plus DeepSpeed's stage enum and its two loss-scaler classes (stand-ins)."""
    from .lightning_pickle import allowed_globals as lightning_globals

    out = lightning_globals()
    out[ZERO_STAGE_ENUM] = ZeroStage
    out[(_SCALER_MODULE, "LossScaler")] = LossScaler
    out[(_SCALER_MODULE, "DynamicLossScaler")] = DynamicLossScaler
    out[("deepspeed.utils.tensor_fragment", "fragment_address")] = FragmentAddress
    return out


def load_deepspeed_file(path: Path) -> Any:
    """One DeepSpeed ``.pt`` file through the safe unpickler, its tensors memory-mapped."""
    return load_torch_file(path, allowed_globals(), mmap=True)


__all__ = ["DynamicLossScaler", "FragmentAddress", "LossScaler", "ZeroStage", "allowed_globals", "load_deepspeed_file"]
