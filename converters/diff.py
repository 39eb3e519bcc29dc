"""``ckpt diff A B``: two checkpoints in any formats compared tensor by tensor, in bounded memory.

Why through the conversion engine: a user checks a conversion (an NxD tag against the HF model it came from, an HF
folder against our checkpoint) and formats name, shard and lay out the same tensors differently.  Each side is
opened as ``ckpt convert`` opens a source and seen through the engine's full view (:func:`.engine.plan.full_view`:
whole, unsharded, HF-named model tensors and ``optim/<name>/<key>`` optimizer states), so NxD TP shards, fused QKV,
DCP chunks and our boxes all compare as the tensors they make.  PEFT adapter folders (a Trainer's LoRA
``checkpoint-N`` too), NxD LoRA tags and adapter checkpoints of ours are read whole (adapters are small) by the
converters' adapter reader, all under the adapter's HF names.

One pair of tensors is held at a time (sources hand out memory-mapped views where they can), and values are
compared in slices of :data:`SLICE` elements, so memory stays a few tensors whatever the model's size
(tests/test_diff_memory.py).  :func:`compare_digests` is the same comparison on model digests
(:mod:`.digest`), used by ``verify-resume`` to name weights that were not restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt.errors import CkptError
from ckpt.format.manifest import TensorDesc

if TYPE_CHECKING:
    import torch

#: elements compared at once (float64 buffers of 4 MiB each)
SLICE = 1 << 19
MODEL_ROLES = ("parameter", "buffer")


# ------------------------------------------------------------------------------------------------ views


class View:
    """One checkpoint seen as whole, HF-named tensors: ``descs`` (name -> description) and :meth:`tensor`."""

    path: str
    format: str
    descs: dict[str, TensorDesc]
    #: the training step the checkpoint records, None when its format records none (HF, DCP, PEFT folders)
    step: int | None
    #: an accelerate ``sampler.bin`` record (encoded, ``extra.accelerate.sampler``), None when there is none
    sampler: Any = None

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def model_names(self) -> list[str]:
        return [n for n, d in self.descs.items() if d.role in MODEL_ROLES]

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class EngineView(View):
    """A checkpoint ``ckpt convert`` reads, through the engine's CUDA (full) plan; nothing is written."""

    def __init__(self, path: str, config: Mapping[str, Any] | None, run: Any) -> None:
        from .convert import ConvertOptions, open_source, plan_conversion

        opts = ConvertOptions(to="cuda", config=dict(config) if config is not None else None)
        self.source = open_source(path, opts, run)
        try:
            self.conv = plan_conversion(self.source, opts)
        except BaseException:
            self.source.close()
            raise
        self.path, self.format = path, self.source.format
        self.parts = {t.desc.name: t for t in self.conv.tensors}
        self.descs = {n: t.desc for n, t in self.parts.items()}
        step = self.conv.trees.step
        self.step = int(step) if self.source.step_recorded and step is not None else None  # None: no file records one
        from .accelerate_sampler import record_of

        self.sampler = record_of(self.conv.trees.extra)
        self.verify = run.verify

    def tensor(self, name: str) -> torch.Tensor:
        from .engine import produce

        (part,) = self.parts[name].parts
        return produce(self.conv, part, verify=self.verify)

    def close(self) -> None:
        self.source.close()


class AdapterView(View):
    """A LoRA adapter (PEFT folder, NxD LoRA tag), read whole: ``<module>.lora_A.weight`` names, optimizer states
    as ``optim/<name>/<key>`` when the adapter carries them."""

    def __init__(self, path: str, config: Mapping[str, Any] | None, run: Any, found: Any = None) -> None:
        import torch

        from .formats import detect_adapter
        from .lora import read_any, source_step
        from .lora_trainer import is_trainer_folder
        from .options import ConvertOptions

        found = found if found is not None else detect_adapter(path, run.storage_options)
        adapter, _ = read_any(found, ConvertOptions(to="cuda", config=dict(config) if config else None), run)
        kind = found.format.name
        trainer = kind == "peft" and is_trainer_folder(path)
        self.path = path
        self.format = "hf-trainer-lora" if trainer else {"peft": "peft", "ckpt": "ckpt-lora"}.get(kind, "nxd-lora")
        self._tensors: dict[str, torch.Tensor] = dict(adapter.tensors)
        for pname, st in ((adapter.optimizer or {}).get("state") or {}).items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    self._tensors[f"optim/{pname}/{key}"] = v
        self.descs = {
            n: TensorDesc(
                n,
                "optimizer_state" if n.startswith("optim/") else "parameter",
                tuple(t.shape),
                _dtype_name(t.dtype),
            )
            for n, t in self._tensors.items()
        }
        self.step = source_step(found, run)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def _is_peft(path: str) -> bool:
    from . import peft

    return peft.detect(path)


def _dtype_name(dtype: torch.dtype) -> str:
    from ckpt.format.dtypes import dtype_name

    return dtype_name(dtype)


def open_view(path: str, *, config: Mapping[str, Any] | None = None, **run_options: Any) -> View:
    """``path`` in whatever format it is in, as a :class:`View` (one-line error when it is not a checkpoint)."""
    from .nxd import lora as nxd_lora
    from .options import RunOptions

    run = RunOptions(**run_options)
    if _is_peft(path) or nxd_lora.is_lora_tag(path):
        return AdapterView(path, config, run)
    if _is_ours(path):  # an adapter checkpoint of ours is seen with adapter names, as the folders it came from
        from .formats import detect_adapter

        found = detect_adapter(path, run.storage_options)
        if found.adapter and found.format.name == "ckpt":
            return AdapterView(path, config, run, found)
    return EngineView(path, config, run)


def _is_ours(path: str) -> bool:
    from pathlib import Path

    return "://" in path or (Path(path) / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class TensorDiff:
    """One name both checkpoints hold.  ``equal``: the same bytes; ``within``: every element within
    ``atol + rtol * |b|`` (and the same shape and dtype); ``differing``: elements outside the tolerance, the first of
    them at ``first_index`` (``a_value`` / ``b_value``)."""

    name: str
    role: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    equal: bool
    within: bool
    max_abs: float | None = None
    max_rel: float | None = None
    differing: int = 0
    first_index: tuple[int, ...] | None = None
    a_value: float | None = None
    b_value: float | None = None

    @property
    def what(self) -> str:
        """A few words: ``equal``, ``shape [4, 8] -> [8, 4]``, ``max abs 1e-3 ...``."""
        if self.shape_a != self.shape_b:
            return f"shape {list(self.shape_a)} -> {list(self.shape_b)}"
        parts = []
        if self.dtype_a != self.dtype_b:
            parts.append(f"dtype {self.dtype_a} -> {self.dtype_b}")
        if self.equal:
            return "equal"
        if self.max_abs is not None and (self.max_abs > 0 or math.isnan(self.max_abs)):
            parts.append(f"max abs {self.max_abs:.6g}, max rel {self.max_rel:.6g}")
        if self.differing:
            at = list(self.first_index or ())
            parts.append(
                f"{self.differing} element{'s' if self.differing != 1 else ''} outside tolerance, first at {at} "
                f"({self.a_value!r} vs {self.b_value!r})"
            )
        return "; ".join(parts) or "equal within tolerance"


@dataclass
class DiffResult:
    """What :func:`diff` found.  ``only_a`` / ``only_b``: names one side holds (optimizer states are not listed when
    only one side holds an optimizer at all: ``optimizer`` says so); ``tensors``: every name both hold; ``state``:
    the training state besides tensors that differs (accelerate's sampler)."""

    a: str
    b: str
    format_a: str
    format_b: str
    atol: float
    rtol: float
    tensors: list[TensorDiff] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    step_a: int | None = None
    step_b: int | None = None
    optimizer: str = "compared"
    notes: list[str] = field(default_factory=list)
    #: training state that differs besides tensors and step (an accelerate sampler's seed, epoch, ...)
    state: list[str] = field(default_factory=list)

    @property
    def changed(self) -> list[TensorDiff]:
        return [t for t in self.tensors if not t.within]

    @property
    def steps_differ(self) -> bool:
        return self.step_a is not None and self.step_b is not None and self.step_a != self.step_b

    @property
    def same(self) -> bool:
        """Equal within tolerance: the same names, shapes, dtypes and values, and the same step where both
        record one."""
        return not (self.changed or self.only_a or self.only_b or self.steps_differ or self.state)

    @property
    def exit_code(self) -> int:
        return 0 if self.same else 1

    def to_json(self) -> dict[str, Any]:
        def finite(x: float | None) -> float | str | None:
            return x if x is None or math.isfinite(x) else str(x)

        rows = []
        for t in self.tensors:
            row = asdict(t)
            row.update(max_abs=finite(t.max_abs), max_rel=finite(t.max_rel))
            row.update(a_value=finite(t.a_value), b_value=finite(t.b_value))
            row["shape_a"], row["shape_b"] = list(t.shape_a), list(t.shape_b)
            row["first_index"] = None if t.first_index is None else list(t.first_index)
            rows.append(row)
        return {
            "a": {"path": self.a, "format": self.format_a, "step": self.step_a},
            "b": {"path": self.b, "format": self.format_b, "step": self.step_b},
            "atol": self.atol,
            "rtol": self.rtol,
            "same": self.same,
            "compared": len(self.tensors),
            "equal": sum(t.equal for t in self.tensors),
            "changed": [t.name for t in self.changed],
            "only_a": self.only_a,
            "only_b": self.only_b,
            "optimizer": self.optimizer,
            "notes": self.notes,
            "state": self.state,
            "tensors": rows,
        }


# ------------------------------------------------------------------------------------------------ comparing


def compare_tensors(
    name: str, role: str, a: torch.Tensor, b: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0
) -> TensorDiff:
    """Compare two tensors in slices of :data:`SLICE` elements (float64), never a full-size temporary."""
    import torch

    from ckpt.layouts import bit_equal

    da, db = _dtype_name(a.dtype), _dtype_name(b.dtype)
    base = dict(name=name, role=role, shape_a=tuple(a.shape), shape_b=tuple(b.shape), dtype_a=da, dtype_b=db)
    if tuple(a.shape) != tuple(b.shape):
        return TensorDiff(**base, equal=False, within=False)
    if da == db and bit_equal(a, b):
        return TensorDiff(**base, equal=True, within=True, max_abs=0.0, max_rel=0.0)
    fa, fb = a.reshape(-1), b.reshape(-1)
    n = fa.numel()
    max_abs = max_rel = 0.0
    differing = 0
    first: int | None = None
    for start in range(0, n, SLICE):
        x = fa[start : start + SLICE].to(torch.float64)
        y = fb[start : start + SLICE].to(torch.float64)
        same_nan = torch.isnan(x) & torch.isnan(y)
        d = (x - y).abs()
        d = torch.where(same_nan, torch.zeros_like(d), d)
        d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)  # NaN against a number
        ya = y.abs()
        rel = torch.where(d == 0, torch.zeros_like(d), d / ya)  # x / 0 -> inf
        max_abs = max(max_abs, float(d.max())) if d.numel() else max_abs
        max_rel = max(max_rel, float(rel.max())) if rel.numel() else max_rel
        bad = d > atol + rtol * ya
        count = int(bad.sum())
        if count and first is None:
            first = start + int(bad.nonzero()[0, 0])
        differing += count
        del x, y, d, rel, ya, bad, same_nan
    index = tuple(int(i) for i in _unravel(first, tuple(a.shape))) if first is not None else None
    return TensorDiff(
        **base,
        equal=False,
        within=differing == 0 and da == db,
        max_abs=max_abs,
        max_rel=max_rel,
        differing=differing,
        first_index=index,
        a_value=float(fa[first]) if first is not None else None,
        b_value=float(fb[first]) if first is not None else None,
    )


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(flat % s)
        flat //= s
    return list(reversed(out))


def diff(
    a: str,
    b: str,
    *,
    config: Mapping[str, Any] | None = None,
    config_b: Mapping[str, Any] | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    **run_options: Any,
) -> DiffResult:
    """Compare checkpoints ``a`` and ``b`` (any formats ``ckpt convert`` reads, or LoRA adapters) tensor by tensor.

    ``config`` is the HF ``config.json`` dict an NxD tag needs (used for both sides unless ``config_b`` is given);
    ``atol`` / ``rtol``: element ``x`` of A matches ``y`` of B when ``|x - y| <= atol + rtol * |y|`` (default: bit
    equality).  ``on_plan(nbytes)`` gets the bytes of B to compare (a progress bar's total), ``progress(nbytes)``
    each compared tensor's.  Run options (``allow_unmarked``, ``verify``, ``storage_options``) as for convert.
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise CkptError(f"--atol {atol} / --rtol {rtol}: tolerances are numbers >= 0")
    va = open_view(a, config=config, **run_options)
    try:
        vb = open_view(b, config=config_b if config_b is not None else config, **run_options)
    except BaseException:
        va.close()
        raise
    try:
        return _diff_views(va, vb, atol, rtol, progress, on_plan)
    finally:
        va.close()
        vb.close()


def _diff_views(
    va: View,
    vb: View,
    atol: float,
    rtol: float,
    progress: Callable[[int], None] | None,
    on_plan: Callable[[int], None] | None,
) -> DiffResult:
    out = DiffResult(va.path, vb.path, va.format, vb.format, atol, rtol, step_a=va.step, step_b=vb.step)
    optim_a = any(d.role == "optimizer_state" for d in va.descs.values())
    optim_b = any(d.role == "optimizer_state" for d in vb.descs.values())
    skip_optim = optim_a != optim_b
    if skip_optim:
        held, other = (va, vb) if optim_a else (vb, va)
        out.optimizer = f"only in {held.path} ({held.format}); {other.path} holds none: not compared"
    elif not optim_a:
        out.optimizer = "neither holds optimizer state"

    def kept(d: TensorDesc) -> bool:
        return not (skip_optim and d.role == "optimizer_state")

    names_a = [n for n, d in va.descs.items() if kept(d)]
    names_b = [n for n, d in vb.descs.items() if kept(d)]
    set_a, set_b = set(names_a), set(names_b)
    out.only_a = [n for n in names_a if n not in set_b]
    out.only_b = [n for n in names_b if n not in set_a]
    common = [n for n in names_b if n in set_a]
    if on_plan is not None:
        on_plan(sum(vb.descs[n].nbytes for n in common))
    for n in common:
        ta = va.tensor(n)
        tb = vb.tensor(n)
        out.tensors.append(compare_tensors(n, vb.descs[n].role, ta, tb, atol=atol, rtol=rtol))
        del ta, tb
        if progress is not None:
            progress(vb.descs[n].nbytes)
    from .accelerate_sampler import differences

    out.state = differences(va.sampler, vb.sampler)
    if va.step is None or vb.step is None:
        which = [v.path for v in (va, vb) if v.step is None]
        out.notes.append(f"step not compared: {' and '.join(which)} record{'s' if len(which) == 1 else ''} none")
    return out


# ------------------------------------------------------------------------------------------------ digests


__all__ = [
    "DiffResult",
    "TensorDiff",
    "View",
    "compare_tensors",
    "diff",
    "open_view",
]
