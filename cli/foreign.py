"""``inspect`` / ``verify`` of the folders ``convert`` reads but that are not ours: Hugging Face, DCP and PEFT adapter
folders (a Trainer's LoRA ``checkpoint-N`` with its optimizer moments).

They carry no checksums, so ``verify`` checks what they do say: every file present, every safetensors header
consistent with its file's size, every tensor readable at its shape and dtype.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from ckpt.words import count

from .common import human_bytes, out
from .table import Col, print_table


def _title(source: Any) -> str:
    """The format's name in prose: the source's own, else the format table's."""
    from ckpt.converters import formats

    return getattr(source, "title", None) or str(formats.get(source.format))


def open_foreign(path: str) -> Any:
    """The conversion source of an HF, DCP or adapter folder at ``path`` (one-line errors from the reader)."""
    from ckpt.converters import formats, peft

    if peft.detect(path):
        from ckpt.converters.lora_trainer import AdapterFolder

        return AdapterFolder(path)
    fmt = formats.detect(path)
    return fmt.load().open_source(path)


def inspect_foreign(path: str, as_json: bool) -> None:
    from ckpt.converters.accelerate_sampler import describe, facts, record_of

    source = open_foreign(path)
    try:
        tensors = source.tensors
        sampler = record_of(getattr(getattr(source, "trees", None), "extra", None))
        total = sum(d.nbytes for d in tensors.values())
        if as_json:
            doc = {
                "path": path,
                "format": source.format,
                "layout": source.layout,
                "step": source.trees.step if getattr(source, "step_recorded", False) else None,
                "bytes": total,
                "tensors": {
                    n: {"role": d.role, "shape": list(d.shape), "dtype": d.dtype} for n, d in tensors.items()
                },
            }
            if sampler is not None:  # an accelerate sampler.bin
                doc["sampler"] = facts(sampler)
            click.echo(json.dumps(doc, indent=2))
            return
        step = f"  step {source.trees.step}" if getattr(source, "step_recorded", False) else ""
        what = "file" if os.path.isfile(path) else "folder"
        out.print(
            f"{path}  {_title(source)} {what}{step}  {source.layout} layout  {count(len(tensors), 'tensor')}  {human_bytes(total)}",
            markup=False,
        )
        rows = [
            [n, d.role + (f" ({d.key})" if d.key else ""), str(list(d.shape)), d.dtype, human_bytes(d.nbytes)]
            for n, d in tensors.items()
        ]
        cols = [
            Col("tensor", name=True),
            Col("role", fold=True),
            Col("shape"),
            Col("dtype"),
            Col("size", "right"),
        ]
        print_table(out, cols, rows)
        if sampler is not None:
            out.print(f"sampler: {describe(sampler)}", markup=False)
    finally:
        source.close()


def verify_foreign(path: str, as_json: bool) -> list[str]:
    """Read every tensor of the folder; returns the problems found (empty: all readable)."""
    from ckpt.errors import CkptError
    from ckpt.format.dtypes import dtype_from_name
    from ckpt.layouts import Piece

    source = open_foreign(path)  # headers and sizes are checked on opening
    problems: list[str] = []
    try:
        for name, d in source.tensors.items():
            try:
                t = source.read(Piece(name, None, None))
            except CkptError as e:
                problems.append(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - a foreign reader's own error about a damaged file
                problems.append(f"tensor {name!r}: unreadable ({type(e).__name__}: {e})")
                continue
            if tuple(t.shape) != tuple(d.shape) or t.dtype != dtype_from_name(d.dtype):
                problems.append(
                    f"tensor {name!r}: read {list(t.shape)} {t.dtype}, header says {list(d.shape)} {d.dtype}"
                )
        n = len(source.tensors)
    finally:
        source.close()
    if as_json:
        click.echo(json.dumps({"path": path, "format": source.format, "ok": not problems, "tensors": n,
                               "problems": problems, "checksums": False}, indent=2))  # fmt: skip
    elif not problems:
        out.print(
            f"ok {path}: {_title(source)} folder, {count(n, 'tensor')} readable at their header's shape and dtype "
            "(the format has no checksums)",
            markup=False,
        )
    return problems
