"""Which files one NxD tag directory holds, what parallel sizes they imply, and which expected files are missing.

A "tag" here is any directory holding NxD rank files: a training tag (``model/``, ``optim/``, markers), the
converter's marker-less output (a folder with ``model/`` holding ``dp_rank_00_tp_rank_XX_pp_rank_YY.pt``, or that
``model/`` folder itself), or a legacy ``parallel_layers.checkpointing.save`` directory
(``tp_rank_XX_pp_rank_YY/checkpoint.pt`` or xser ``tp_rank_XX_pp_rank_YY`` + ``.tensors/``).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError

from .naming import RankKey, parse_legacy_name, parse_rank_file, part_of_tag, rank_file_name
from .xser import collect_refs, ep00_path, read_info, tensor_file, tensors_dir


@dataclass(frozen=True)
class TagFiles:
    """The rank files found under one tag directory (paths are absolute)."""

    path: Path
    model: dict[RankKey, Path] = field(default_factory=dict)
    optim: dict[tuple[int, RankKey], Path] = field(default_factory=dict)  # (dp, rank) -> file
    legacy: dict[RankKey, Path] = field(default_factory=dict)  # legacy entries, DP rank 0 only
    xser: bool = False
    has_checkpoint_marker: bool = False
    has_done: bool = False
    scheduler: Path | None = None
    user_content: Path | None = None

    @property
    def ranks(self) -> list[RankKey]:
        return sorted(self.model or self.legacy)

    @property
    def _all_keys(self) -> set[RankKey]:
        # sizes come from every file name, so a missing last-rank model file is reported, not silently dropped
        return set(self.model) | set(self.legacy) | {k for _, k in self.optim}

    @property
    def tp_size(self) -> int:
        return 1 + max((k[0] for k in self._all_keys), default=0)

    @property
    def pp_size(self) -> int:
        return 1 + max((k[1] for k in self._all_keys), default=0)

    @property
    def ep_size(self) -> int:
        return 1 + max((k[2] for k in self._all_keys), default=0)

    @property
    def dp_size(self) -> int:
        """Number of optimizer DP shards (ZeRO-1); 1 without ZeRO-1 or without an optimizer."""
        return 1 + max((dp for dp, _ in self.optim), default=0)

    @property
    def is_legacy(self) -> bool:
        return bool(self.legacy) and not self.model


def is_xser_dir(tag_dir: Path) -> bool:
    """NxD's rule (``is_checkpoint_xser``): any ``*.tensors`` folder in the tag's subfolders (we also look at the tag
    folder itself, for legacy and bare ``model/`` inputs)."""
    for d in [tag_dir, *(p for p in tag_dir.iterdir() if p.is_dir())]:
        if any(c.name.endswith(".tensors") and c.is_dir() for c in d.iterdir()):
            return True
    return False


def scan_tag(path: str | Path) -> TagFiles:
    """List the NxD files under ``path``; raises CkptError when it holds none."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CkptError(f"{path}: not a directory")
    part = part_of_tag(path)
    if part is not None:
        raise CkptError(part)
    model_dir = path / "model"
    if not model_dir.is_dir() and any(parse_rank_file(p.name) for p in path.iterdir()):
        model_dir = path  # the converter's model/ folder given directly
    model: dict[RankKey, Path] = {}
    if model_dir.is_dir():
        for p in model_dir.iterdir():
            rf = parse_rank_file(p.name)
            if rf is not None and p.is_file():
                model[rf.key] = p
    optim: dict[tuple[int, RankKey], Path] = {}
    if (path / "optim").is_dir():
        for p in (path / "optim").iterdir():
            rf = parse_rank_file(p.name)
            if rf is not None and p.is_file():
                optim[(rf.dp, rf.key)] = p
    legacy: dict[RankKey, Path] = {}
    for p in path.iterdir():
        rf = parse_legacy_name(p.name)
        if rf is None or rf.dp != 0:
            continue
        if p.is_dir() and (p / "checkpoint.pt").is_file():
            legacy[rf.key] = p / "checkpoint.pt"
        elif p.is_file():
            legacy[rf.key] = p
    if not model and not legacy and not optim:
        raise CkptError(
            f"{path}: no NxD rank files (model/dp_rank_*_tp_rank_*_pp_rank_*.pt or tp_rank_*_pp_rank_*)"
        )
    sched, user = path / "scheduler.pt", path / "user_content.pt"
    return TagFiles(
        path=path,
        model=model,
        optim=optim,
        legacy=legacy,
        xser=is_xser_dir(path),
        has_checkpoint_marker=(path / "checkpoint").is_file(),
        has_done=(path / "done").is_file(),
        scheduler=sched if sched.is_file() else None,
        user_content=user if user.is_file() else None,
    )


def _grid_problems(kind: str, present: set[RankKey], tp: int, pp: int, ep: int) -> list[str]:
    def expected(t: int, p: int, e: int) -> str:
        if kind == "legacy":
            return f"tp_rank_{t:02d}_pp_rank_{p:02d}"
        return f"{kind}/{rank_file_name(0, t, p, e if ep > 1 else None)}"

    return [
        f"{kind} file of tp {t} pp {p} ep {e} missing ({expected(t, p, e)})"
        for t in range(tp)
        for p in range(pp)
        for e in range(ep)
        if (t, p, e) not in present
    ]


def _file_problems(f: Path, xser: bool) -> list[str]:
    """A cheap integrity check: the zip directory is readable, and every tensor an xser ref file names exists."""
    if not zipfile.is_zipfile(f):
        return [f"{f}: not a complete torch.save zip (truncated?)"]
    if not xser:
        return []
    info = read_info(f) if (Path(f"{f}.info.pt")).is_file() else None
    if info is not None:
        tids = sorted(info)
    else:
        from ckpt.safe_unpickle import load_torch_file

        tids = [r.tid for r in collect_refs(load_torch_file(f))]
    if not tensors_dir(f).is_dir():
        return [f"{tensors_dir(f)}: missing"]
    if info is not None and not any(tensors_dir(f).iterdir()):
        return []  # avoid_saving_lower_precision_weights: tensors only in the optimizer's master weights
    ep00 = ep00_path(f)
    missing, torn = [], []
    for t in tids:
        own = tensor_file(f, t)
        found = own if own.is_file() else (tensor_file(ep00, t) if ep00 is not None else None)
        if found is None or not found.is_file():
            missing.append(own)
        elif not zipfile.is_zipfile(found):
            torn.append(found)
    if missing:
        return [f"{missing[0]}: missing ({len(missing)} tensor files missing)"]
    return [f"{torn[0]}: not a complete torch.save zip (truncated?)"] if torn else []


def _optimizer_gone(files: TagFiles) -> list[str]:
    """A training tag that had an optimizer but holds none of its files: an empty ``optim/`` folder, or a
    ``scheduler.pt`` (NxD saves a scheduler with its optimizer) without ``optim/``.  Its grid cannot show the gap,
    and read as it is the tag would silently convert to weights alone."""
    optim = files.path / "optim"
    if optim.is_dir():
        return [f"{optim}: holds no optimizer rank files (optim/dp_rank_*_tp_rank_*_pp_rank_*.pt)"]
    if files.scheduler is not None and (files.has_done or files.has_checkpoint_marker):
        return [f"{optim}: missing (the tag holds scheduler.pt, so its save had an optimizer)"]
    return []


def missing_rank_files(files: TagFiles) -> list[str]:
    """The model/optim (or legacy) rank files that the tag's grid expects but are absent, one line each.

    The grid is inferred from the file names present (tp/pp/ep sizes = 1 + the highest rank named by any model or
    optim file; DP size from the optim files), so a gap is seen only below the highest named rank: a tag whose every
    file of its highest TP (or PP, or DP) rank is gone looks like a smaller complete tag.  NxD records the parallel
    sizes nowhere in the files (``.info.pt`` holds tensor dtypes and shapes only).
    """
    if files.is_legacy:
        return _grid_problems("legacy", set(files.legacy), files.tp_size, files.pp_size, 1)
    problems = _grid_problems("model", set(files.model), files.tp_size, files.pp_size, files.ep_size)
    if not files.optim:
        problems += _optimizer_gone(files)
    if files.optim:
        # ZeRO-1 names optim files without ep; a non-ZeRO run with EP names them like the model files
        ep = files.ep_size if files.dp_size == 1 else 1
        have = set(files.optim)
        for dp in range(files.dp_size):
            problems += [
                f"optim file of dp {dp} tp {t} pp {p} ep {e} missing "
                f"(optim/{rank_file_name(dp, t, p, e if ep > 1 else None)})"
                for t in range(files.tp_size)
                for p in range(files.pp_size)
                for e in range(ep)
                if (dp, (t, p, e)) not in have
            ]
    return problems


def find_problems(files: TagFiles) -> list[str]:
    """Everything a complete tag should hold but this one lacks (empty list = all files present).

    Cheap (used by ``ckpt ls``): file names, zip directories and xser tensor-file presence; no CRC check.
    """
    problems = missing_rank_files(files)
    if files.is_legacy:
        return problems
    for f in [*files.model.values(), *files.optim.values(), files.scheduler, files.user_content]:
        if f is not None:
            problems += _file_problems(f, files.xser and f.parent.name in ("model", "optim"))
    return problems
