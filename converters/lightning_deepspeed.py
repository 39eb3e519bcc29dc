"""The folder Lightning's DeepSpeedStrategy writes where ``ModelCheckpoint`` names a ``.ckpt`` path, as a source,
read without DeepSpeed.

Lightning calls ``engine.save_checkpoint(path, client_state=<its checkpoint dict less state_dict and
optimizer_states>, tag="checkpoint")``, so the folder holds ``latest`` and ``checkpoint/``:

- ``mp_rank_00_model_states.pt`` (stages 1, 2; stage 3: one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per
  rank): ``module`` (stages 1/2: the 16- or 32-bit weights; stage 3: empty placeholders), ``param_shapes`` (per
  param group, the trainable parameters' names and shapes in the order the partitions hold them),
  ``buffer_names``, ``shared_params``, ``frozen_param_shapes``/``frozen_param_fragments``, ``ds_config``,
  ``ds_version``, ``global_steps``, ... and Lightning's entries (``global_step``, ``loops``, ``callbacks``,
  ``lr_schedulers``, ``hyper_parameters``, ...);
- ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank: ``optimizer_state_dict`` with
  ``zero_stage``, ``partition_count``, the rank's fp32 master partition (``single_partition_of_fp32_groups``,
  stage 3: ``fp32_flat_groups``) and the wrapped torch optimizer's state (``base_optimizer_state``, stage 3:
  ``optimizer_state_dict``) whose moments are flat partitions laid out like the fp32 ones.

What the source holds: the fp32 master weights per parameter name (what DeepSpeed's ``zero_to_fp32`` makes),
buffers and frozen parameters as saved, Adam's moments per parameter name (``optim/<name>/exp_avg``), the
optimizer's param_groups and ``step`` per parameter, ``global_step`` as the step, Lightning's other entries in
``extra.lightning`` (as a ``.ckpt`` source keeps them) and DeepSpeed's record (stage, ranks, config, loss scaler)
in ``extra.deepspeed``.  With ``--config`` the HF model's prefix is taken off (:func:`.hf_prefix.model_prefix`).
The layout arithmetic is :mod:`.deepspeed_zero`; the pickles go through :mod:`.deepspeed_pickle`'s allow-list.

Refused, one line each: model or pipeline parallelism (``mp_rank_01``, ``layer_*`` files, a parallel degree above
1), ``bf16_zero_*`` files (DeepSpeed's BF16_Optimizer layout), elastic checkpoints, a missing or extra rank file,
and partitions whose sizes do not add up to ``param_shapes``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CkptError, CorruptionError, LayoutError
from ckpt.format import treecodec
from ckpt.format.dtypes import dtype_name
from ckpt.format.manifest import TensorDesc
from ckpt.integrations.lightning_state import EXTRA_KEY, split
from ckpt.layouts import Piece
from ckpt.restoring.other_tools import DEEPSPEED_TAG

from .deepspeed_pickle import load_deepspeed_file
from .deepspeed_zero import Slot, gather, zero3_slots, zero12_slots
from .engine import Source, Trees
from .engine.source import slice_of
from .hf_prefix import model_prefix

#: DeepSpeed's own entries of a model-states file; every other entry is Lightning's (its client_state)
DEEPSPEED_KEYS = frozenset(
    {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
     "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
     "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
     "checkpoint_parallel_dimensions"}
)  # fmt: skip
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt")


def _model_file(tag: Path, rank: int, stage3: bool) -> Path:
    return tag / (f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage3 else "mp_rank_00_model_states.pt")


def _optim_file(tag: Path, rank: int) -> Path:
    return tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _refuse_parallel(tag: Path, names: list[str]) -> None:
    """Model/pipeline parallel and BF16_Optimizer folders: one line naming the file that shows it."""
    for n in sorted(names):
        m = re.search(r"mp_rank_(\d+)_", n)
        if m and int(m.group(1)) != 0:
            raise CkptError(f"{tag / n}: a model-parallel DeepSpeed checkpoint (mp rank above 0); ckpt reads "
                            "data-parallel ZeRO folders only")  # fmt: skip
        if n.startswith("layer_") and n.endswith("-model_states.pt"):
            raise CkptError(f"{tag / n}: a pipeline-parallel DeepSpeed checkpoint (per-layer files); ckpt reads "
                            "data-parallel ZeRO folders only")  # fmt: skip
        if n.startswith("bf16_zero_pp_rank_") or n.startswith("expp_rank_") or n.startswith("expert_"):
            raise CkptError(f"{tag / n}: DeepSpeed's {'BF16_Optimizer' if n.startswith('bf16') else 'MoE'} "
                            "checkpoint layout; ckpt reads the ZeRO stage 1/2/3 optimizer's files only")  # fmt: skip


def _dict(obj: Any, key: str, where: Path) -> Any:
    if not isinstance(obj, Mapping) or key not in obj:
        raise CorruptionError(f"{where}: not a DeepSpeed ZeRO checkpoint file (no {key})")
    return obj[key]


def _world(osd: Mapping[str, Any], where: Path) -> int:
    count = _dict(osd, "partition_count", where)
    counts = set(count) if isinstance(count, list) else {count}
    if len(counts) != 1 or not all(type(c) is int and c > 0 for c in counts):
        raise LayoutError(f"{where}: partition_count {count!r} (per-group data-parallel sizes that differ)")
    return counts.pop()


def _group_states(base: Any, n_groups: int, where: Path) -> list[dict[str, Any]]:
    """The torch optimizer's per-flat-group state (its parameters are the rank's flat fp32 groups, in order)."""
    if not isinstance(base, Mapping) or "state" not in base or "param_groups" not in base:
        raise LayoutError(f"{where}: base optimizer state is a {type(base).__name__}, not a torch optimizer "
                          "state_dict (an elastic checkpoint?); not read")  # fmt: skip
    order = [i for g in base["param_groups"] for i in g["params"]]
    if len(order) != n_groups:
        raise LayoutError(f"{where}: the optimizer holds {len(order)} flat parameters for {n_groups} fp32 groups")
    return [dict(base["state"].get(i, {})) for i in order]


class DeepSpeedSource(Source):
    """Lightning's DeepSpeed checkpoint folder (see the module docstring)."""

    format = "lightning"
    layout = "cuda"

    def __init__(self, path: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        self.path = str(path)
        tag = Path(path) / DEEPSPEED_TAG
        names = sorted(p.name for p in tag.iterdir())
        _refuse_parallel(tag, names)
        stage3 = "mp_rank_00_model_states.pt" not in names
        head = load_deepspeed_file(self._need(_model_file(tag, 0, stage3)))
        if _dict(head, "param_shapes", _model_file(tag, 0, stage3)) is None:
            raise CkptError(f"{_model_file(tag, 0, stage3)}: saved without a ZeRO optimizer (no param_shapes); "
                            "ckpt reads ZeRO stage 1/2/3 folders")  # fmt: skip
        dims = head.get("checkpoint_parallel_dimensions") or {}
        if head.get("mp_world_size", 1) != 1 or any(v != 1 for v in dims.values()):
            raise CkptError(f"{_model_file(tag, 0, stage3)}: model/pipeline parallel degrees "
                            f"{dict(dims, mp=head.get('mp_world_size'))}; ckpt reads data-parallel ZeRO only")
        if ((head.get("ds_config") or {}).get("zero_optimization") or {}).get("elastic_checkpoint"):
            raise CkptError(f"{self.path}: an elastic ZeRO checkpoint (elastic_checkpoint: true); not read")
        osds = [_dict(load_deepspeed_file(self._need(_optim_file(tag, 0))), "optimizer_state_dict", tag)]
        stage, world = int(_dict(osds[0], "zero_stage", _optim_file(tag, 0))), _world(osds[0], _optim_file(tag, 0))
        if (stage == 3) != stage3:
            raise LayoutError(f"{_optim_file(tag, 0)}: ZeRO stage {stage}, but the model-states files are stage "
                              f"{'3' if stage3 else '1/2'}'s")  # fmt: skip
        ranks = {int(m.group(1)) for n in names if (m := _RANK_FILE.fullmatch(n)) and m.group(3) == "optim"}
        if ranks - set(range(world)):
            raise LayoutError(f"{tag}: optimizer files for ranks {sorted(ranks)}; partition_count says {world}")
        osds += [_dict(load_deepspeed_file(self._need(_optim_file(tag, r))), "optimizer_state_dict",
                       _optim_file(tag, r)) for r in range(1, world)]  # fmt: skip
        models = [head] + [load_deepspeed_file(self._need(_model_file(tag, r, True))) for r in range(1, world)
                           if stage3]  # fmt: skip
        key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
        self._flat = [list(_dict(o, key, _optim_file(tag, r))) for r, o in enumerate(osds)]
        base_key = "optimizer_state_dict" if stage3 else "base_optimizer_state"
        states = [_group_states(_dict(o, base_key, _optim_file(tag, r)), len(self._flat[r]), _optim_file(tag, r))
                  for r, o in enumerate(osds)]  # fmt: skip
        moment_keys = [k for k, v in states[0][0].items() if isinstance(v, torch.Tensor) and v.dim() > 0] \
            if states[0] else []  # fmt: skip
        for r, st in enumerate(states):
            for g, s in enumerate(st):
                if any(not isinstance(s.get(k), torch.Tensor) for k in moment_keys):
                    raise LayoutError(f"{_optim_file(tag, r)}: flat group {g}'s optimizer state has "
                                      f"{sorted(s)}; rank 0's first has {moment_keys}")  # fmt: skip
        self._moment = {k: [[s[k] for s in st] for st in states] for k in moment_keys}
        where = str(tag)
        shapes = head["param_shapes"]
        if stage3:
            merged = {n: s for group in shapes for n, s in group.items()}
            self._slots = zero3_slots(merged, [[t.numel() for t in f] for f in self._flat], where)
            expect = [[t.numel() for t in f] for f in self._flat]
        else:
            sizes = [[t.numel() for t in f] for f in self._flat]
            totals = [sum(s[g] for s in sizes) for g in range(len(sizes[0]))]
            part = [-(-t // (2 * world)) * 2 * world // world for t in totals]
            self._slots = zero12_slots(shapes, sizes, part, osds[0].get("param_alignment_paddings"), where)
            expect = [part for _ in range(world)]
        for k, per_rank in self._moment.items():
            got = [[t.numel() for t in groups] for groups in per_rank]
            if got != expect:
                raise LayoutError(f"{where}: {k} partitions hold {got} elements; the fp32 partitions need {expect}")
        self._whole: dict[str, torch.Tensor] = {}
        self._add_rest(head, models, stage3, world, where)
        self._init_trees(head, osds, states, stage, world, config)

    def _need(self, file: Path) -> Path:
        if not file.is_file():
            raise CkptError(f"{file}: missing (a rank's ZeRO partition; the folder is incomplete)")
        return file

    def _add_rest(self, head: Mapping[str, Any], models: list[Any], stage3: bool, world: int, where: str) -> None:
        """Buffers, frozen parameters and the aliases of shared ones: whole tensors, as saved."""
        module = head["module"]
        for n in head.get("buffer_names") or []:
            if n not in module:
                raise CorruptionError(f"{where}: buffer {n} is listed in buffer_names but not saved in module")
            self._whole[n] = module[n]
        for n, shape in (head.get("frozen_param_shapes") or {}).items():
            frags = [m["frozen_param_fragments"][n] for m in models]
            whole = frags[0] if not stage3 else torch.cat([f.reshape(-1) for f in frags])
            numel = int(torch.Size(shape).numel())
            if whole.numel() < numel:
                raise LayoutError(f"{where}: frozen parameter {n} needs {numel} elements; its fragments hold "
                                  f"{whole.numel()}")  # fmt: skip
            self._whole[n] = whole.reshape(-1)[:numel].view(tuple(shape))
        covered = set(self._slots) | set(self._whole) | set(head.get("shared_params") or {})
        for n, t in module.items():
            if n in covered or not isinstance(t, torch.Tensor):
                continue
            if stage3:  # a ZeRO-3 placeholder that no partition holds
                raise LayoutError(f"{where}: module tensor {n} is in no ZeRO partition and not saved whole")
            self._whole[n] = t  # stages 1/2 save every module tensor whole (a parameter left out of the optimizer)
        self._alias = {}
        for alias, target in (head.get("shared_params") or {}).items():
            if target not in self._slots and target not in self._whole:
                raise LayoutError(f"{where}: shared parameter {alias} points at {target}, which is not saved")
            self._alias[alias] = target

    def _init_trees(self, head: Mapping[str, Any], osds: list[Any], states: list[list[dict[str, Any]]],
                    stage: int, world: int, config: Mapping[str, Any] | None) -> None:  # fmt: skip
        """The tensor descriptions (with the HF prefix taken off under --config) and the trees."""
        names = [*self._slots, *self._whole, *self._alias]
        prefix = model_prefix(set(names), config, self.path) if config is not None else ""
        self._source_name = {(n[len(prefix):] if prefix and n.startswith(prefix) else n): n for n in names}
        self.tensors = {}
        for out, n in self._source_name.items():
            shape, dtype = self._meta(n)
            self.tensors[out] = TensorDesc(out, "parameter", shape, dtype)
        strip = {n: o for o, n in self._source_name.items()}
        n_flat = len(self._flat[0])
        of_flat: list[list[str]] = [[] for _ in range(n_flat)]  # the parameters each flat group holds
        for n, slot in self._slots.items():
            for g in sorted({s.group for s in slot.segments}):
                of_flat[g].append(strip[n])
        base = osds[0]["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        order = [i for group in base["param_groups"] for i in group["params"]]
        groups = []
        for g, group in enumerate(base["param_groups"]):
            params = [n for i in group["params"] for n in of_flat[order.index(i)]]
            groups.append({**{k: treecodec.encode(v, f"param_groups[{g}].{k}") for k, v in group.items()
                              if k != "params"}, "params": list(dict.fromkeys(params))})  # fmt: skip
        scalars: dict[str, dict[str, Any]] = {}
        for g, st in enumerate(states[0]):
            small = {k: treecodec.encode(v, f"state.{k}") for k, v in st.items() if k not in self._moment}
            for n in of_flat[g]:
                scalars[n] = small
        for k in self._moment:
            for n in self._slots:
                shape, dtype = self._meta(n, k)
                out = f"optim/{strip[n]}/{k}"
                self.tensors[out] = TensorDesc(out, "optimizer_state", shape, dtype, strip[n], k)
                self._source_name[out] = n
        step = int(head.get("global_step", head.get("global_steps", 0)) or 0)
        self.step_recorded = "global_step" in head or "global_steps" in head
        rest = {k: v for k, v in head.items() if k not in DEEPSPEED_KEYS}
        meta = {strip[n]: torch.empty(self.tensors[strip[n]].shape, device="meta") for n in names}
        tree = split({**rest, "state_dict": meta})[2]
        if prefix:
            tree["prefix"] = prefix
        osd = osds[0]
        scaler = osd.get("loss_scaler")
        record = {
            "zero_stage": stage, "world_size": world, "ds_version": head.get("ds_version"),
            "ds_config": head.get("ds_config"), "global_steps": head.get("global_steps"),
            "global_samples": head.get("global_samples"), "skipped_steps": head.get("skipped_steps"),
            "loss_scaler": scaler.record() if hasattr(scaler, "record") else None,
            "dynamic_loss_scale": osd.get("dynamic_loss_scale"), "overflow": osd.get("overflow"),
        }  # fmt: skip
        extra: dict[str, Any] = {EXTRA_KEY: tree, "deepspeed": treecodec.encode(record, "deepspeed")}
        self.config = dict(config) if config is not None else None
        if self.config is not None:
            extra["config"] = self.config
        optimizer = {"type": "torch.optim.Optimizer", "param_groups": groups, "state": scalars}
        self.trees = Trees(step=step, optimizer=optimizer, progress={"step": step}, extra=extra)
        self.title = f"Lightning DeepSpeed ZeRO-{stage} ({world} rank{'s' if world > 1 else ''})"

    def _meta(self, n: str, moment: str | None = None) -> tuple[tuple[int, ...], str]:
        n = self._alias.get(n, n)
        if n in self._slots:
            flat = self._flat[0][0] if moment is None else self._moment[moment][0][0]
            return self._slots[n].shape, dtype_name(flat.dtype)
        t = self._whole[n]
        return tuple(t.shape), dtype_name(t.dtype)

    def _tensor(self, name: str) -> torch.Tensor:
        n = self._alias.get(self._source_name[name], self._source_name[name])
        desc = self.tensors[name]
        if n in self._whole:
            return self._whole[n]
        slot: Slot = self._slots[n]
        if desc.role == "optimizer_state":
            per_rank = self._moment[desc.key or ""]
            return gather(slot, lambda r, g: per_rank[r][g])
        return gather(slot, lambda r, g: self._flat[r][g])

    def read(self, piece: Piece) -> torch.Tensor:
        t = self._tensor(piece.name)
        return t if piece.dim is None else slice_of(t, piece)

    def close(self) -> None:
        self._flat, self._moment, self._whole = [], {}, {}


__all__ = ["DEEPSPEED_KEYS", "DeepSpeedSource"]
