"""Read TensorBoard event files ourselves, one session per file, every event kept.

TensorBoard's own loader down-samples scalars (10,000 by default) and, after a restart, drops "orphaned"
events whose step is above the restart step.  Those dropped pre-crash steps are exactly the ones a resumed
session must reproduce, so this reader parses the TFRecord framing and the ``Event`` protobufs directly and
keeps each file (one ``SummaryWriter`` lifetime) as its own session.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path

from ckpt.resume.errors import RunInputError
from ckpt.resume.model import Run, Session, StepRecord
from ckpt.resume.sources.base import LogSource, is_phase_name, phase_text
from ckpt.resume.sources.lightning_dirs import version_dirs

FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "train_loss", "training_loss", "lm_loss"),
    "lr": ("lr", "learning_rate", "learningrate"),
    "grad_norm": ("grad_norm", "gradnorm", "grad-norm", "global_grad_norm"),
    "samples": ("samples", "consumed_samples", "samples_seen", "num_samples"),
    "tokens": ("tokens", "consumed_tokens", "tokens_seen", "num_input_tokens_seen"),
    "epoch": ("epoch", "epochs", "train_epoch"),
}
"""Tag names (last component, lowercased) of each field.  ``epoch``, ``samples`` and ``tokens`` are position
fields (HF Trainer, Lightning and Megatron names); curriculum tags (:func:`is_phase_name`) become ``phase``."""


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def iter_records(path: Path, notes: list[str]) -> list[bytes]:
    """TFRecord payloads of ``path``.  The length header's CRC is checked (cheap, catches a wrong file);
    payload CRCs are not (pure-Python CRC32C over every record would dominate the read time).  A record cut
    short by a crash ends the file with a note."""
    data = path.read_bytes()
    out: list[bytes] = []
    pos, end = 0, len(data)
    unpack = struct.unpack_from
    while pos < end:
        if end - pos < 12:
            notes.append(f"{path.name}: truncated record header at byte {pos} (crash while writing)")
            break
        (length,) = unpack("<Q", data, pos)
        (len_crc,) = unpack("<I", data, pos + 8)
        if _masked_crc32c(data[pos : pos + 8]) != len_crc:
            raise RunInputError(f"{path}: bad record header CRC at byte {pos}: not a TensorBoard event file")
        start = pos + 12
        if start + length + 4 > end:
            notes.append(f"{path.name}: truncated last record at byte {pos} (crash while writing)")
            break
        out.append(data[start : start + length])
        pos = start + length + 4
    return out


def _field_for_tags(tags: set[str], override: Mapping[str, str] | None, path: Path) -> dict[str, str]:
    """Map tag -> StepRecord field, choosing among train/eval candidates by preferring 'train'."""
    chosen: dict[str, str] = {}
    for fld, aliases in FIELD_ALIASES.items():
        if override and fld in override:
            if override[fld] in tags:
                chosen[override[fld]] = fld
            continue
        cands = sorted(t for t in tags if t.lower().rsplit("/", 1)[-1] in aliases)
        if len(cands) > 1:
            # train tags win over eval ones (a Trainer with evaluation logs ``eval/loss`` too), then the rank
            trainish = [t for t in cands if "train" in t.lower()]
            cands = trainish or cands
        if len(cands) > 1:
            # The earlier alias is the per-step value: ``Trainer``'s TensorBoardCallback logs ``train/loss``
            # every logging step and ``train/train_loss`` (the run's mean) once at the end.
            rank = {t: aliases.index(t.lower().rsplit("/", 1)[-1]) for t in cands}
            best = [t for t in cands if rank[t] == min(rank.values())]
            cands = best if len(best) == 1 else cands
        if len(cands) > 1:
            raise RunInputError(
                f"{path}: several tags could be the {fld}: {', '.join(cands)}; pass tags={{...}}"
            )
        if cands:
            chosen[cands[0]] = fld
    return chosen


def _value(v: object) -> tuple[float, bool] | None:
    """(value, is_float32) of a summary value, or None for non-scalars (images, histograms, text)."""
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "simple_value":
        return float(v.simple_value), True  # type: ignore[attr-defined]
    if kind == "tensor":
        t = v.tensor  # type: ignore[attr-defined]
        if t.double_val:
            return float(t.double_val[0]), False
        if t.float_val:
            return float(t.float_val[0]), True
        if t.tensor_content and t.dtype in (1, 2) and len(t.tensor_content) in (4, 8):
            fmt = "<f" if t.dtype == 1 else "<d"
            return float(struct.unpack(fmt, t.tensor_content)[0]), t.dtype == 1
    return None


def read_event_file(path: Path, tags: Mapping[str, str] | None, notes: list[str]) -> tuple[Session, bool]:
    """One events file as one session; consecutive events of the same step merge into one record."""
    from tensorboard.compat.proto import event_pb2

    parse = event_pb2.Event.FromString
    raw: list[tuple[int, float, str, float]] = []
    any_f32 = False
    for payload in iter_records(path, notes):
        ev = parse(payload)
        if not ev.HasField("summary"):
            continue
        for v in ev.summary.value:
            got = _value(v)
            if got is not None:
                raw.append((int(ev.step), float(ev.wall_time), v.tag, got[0]))
                any_f32 = any_f32 or got[1]
    mapping = _field_for_tags({r[2] for r in raw}, tags, path)
    phase_tags = {t for _, _, t, _ in raw if t not in mapping and is_phase_name(t)}
    session = Session(id=path.name, origin=str(path))
    cur_step: int | None = None
    cur: dict[str, object] = {}
    phase: dict[str, object] = {}  # the curriculum state carries over steps that log no phase tag

    def flush() -> None:
        if cur_step is not None and set(cur) - {"time"}:
            session.steps.append(StepRecord(step=cur_step, phase=phase_text(phase), **cur))  # type: ignore[arg-type]

    for step, wall, tag, value in raw:
        if tag in phase_tags:
            if step != cur_step:
                flush()
                cur_step, cur = step, {"time": wall}
            phase[tag] = value
            continue
        fld = mapping.get(tag)
        if fld is None:
            continue
        if step != cur_step or fld in cur:
            flush()
            cur_step, cur = step, {"time": wall}
        cur[fld] = int(value) if fld in ("samples", "tokens") else value
    flush()
    return session, any_f32


def find_event_files(path: Path) -> list[Path]:
    """Event files of ``path`` (a file, or a directory searched recursively); they must share one directory,
    since train/ and eval/ writers side by side are different streams, not sessions, unless the directories are
    the ``version_<N>`` folders of one Lightning logger (:mod:`.lightning_dirs`): its sessions."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if "tfevents" in p.name and p.is_file())
    dirs = {p.parent for p in files}
    if len(dirs) > 1 and version_dirs(dirs) is not None:  # Lightning: one version_<N> folder per session
        return files
    if len(dirs) > 1:
        names = sorted(str(d) for d in dirs)
        listed = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
        raise RunInputError(
            f"event files in {len(names)} directories under {path} ({listed}); pass one of them"
        )
    return files


def read_tensorboard(path: str | os.PathLike[str], tags: Mapping[str, str] | None = None) -> Run:
    """All event files of a TensorBoard log directory, each a session, ordered by first wall time.

    ``tags`` maps a field (``loss``, ``lr``, ``grad_norm``, ``samples``, ``tokens``, ``epoch``) to the tag holding it when
    the default aliases (``train/loss``, ``lr``, ``learning_rate``, ...) are not enough.
    """
    p = Path(path)
    if not p.exists():
        raise RunInputError(f"no TensorBoard logs at {p}")
    files = find_event_files(p)
    if not files:
        raise RunInputError(f"no TensorBoard event files under {p}")
    run = Run(path=str(p), source="tensorboard", precision="float64")
    sessions = []
    for f in files:
        session, f32 = read_event_file(f, tags, run.notes)
        if f32:
            run.precision = "float32"
        if session.steps:
            sessions.append(session)
    if not sessions:
        raise RunInputError(f"no loss/lr scalars in the event files under {p}")
    sessions.sort(key=lambda s: (s.steps[0].time or 0.0, s.id))
    run.sessions = sessions
    return run


SOURCE = LogSource(
    name="tensorboard",
    priority=2,
    file_patterns=("*tfevents*",),
    probe=lambda d: any(d.rglob("*tfevents*")),
    looks_for="TensorBoard events",
    read=read_tensorboard,
)
