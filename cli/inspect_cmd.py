"""``ckpt inspect CKPT``: what a checkpoint holds — tensors, shapes, dtypes, shards, and the training state."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from ckpt.words import count

from .common import EXIT_FOUND, err, human_bytes, layout_text, out
from .table import Col, print_table

if TYPE_CHECKING:
    from ckpt.format.reader import CheckpointReader


@click.command(
    epilog="Example: ckpt inspect run/checkpoints/step_00001000 --json\n\nA file absent or not at its manifest's size "
    "is one stderr line. Exit codes: 0 shown, 1 damaged, 2 cannot run (not a checkpoint, unsupported input)."
)
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print the tensors and state as JSON.")
@click.option("--shards", is_flag=True, help="List every shard (file, offset, box, codec).")
def inspect(checkpoint: str, as_json: bool, shards: bool) -> None:
    """Show the tensors (name, role, shape, dtype, shards) and training state of CHECKPOINT.

    CHECKPOINT is one of ours (its folder or its manifest.json), an NxD tag, or a Hugging Face or DCP folder.
    """
    from ckpt.format.reader import CheckpointReader

    from .where import resolve_checkpoint

    checkpoint, kind = resolve_checkpoint(checkpoint, "inspect")
    if kind == "nxd":
        # NxD's reader needs torch: imported only for a folder that is not ours
        from ckpt.converters.nxd import summary as nxd_summary

        _inspect_nxd(nxd_summary.inspect_nxd(checkpoint), as_json)
        return
    if kind in ("hf", "dcp", "adapter", "accelerate", "lightning"):
        from .foreign import inspect_foreign

        inspect_foreign(checkpoint, as_json)
        return
    # the table needs no chunk: format v2 is shown from its top manifest, a rank's index read only for the RNG rule
    reader = CheckpointReader(checkpoint, lazy=not (as_json or shards))
    from ckpt.errors import CkptError
    from ckpt.format.integrity import file_problems

    # what ``ls`` says of a damaged checkpoint, ``inspect`` says too: files absent or not at their manifest's size
    # (a stat each, no reads); shown after what the manifest holds, or instead of it when a damaged file stops that
    bad = file_problems(reader.storage, reader.manifest)
    try:
        _show(reader, checkpoint, as_json, shards)
    except CkptError:
        if not bad:
            raise
    _exit_if_damaged(bad, checkpoint)


def _exit_if_damaged(bad: dict[str, str], checkpoint: str) -> None:
    """One stderr line per damaged file and exit 1 (:data:`.common.EXIT_FOUND`); nothing when there is none."""
    for path, why in bad.items():
        err.print(f"damaged {checkpoint}: {path}: {why}", markup=False)
    if bad:
        sys.exit(EXIT_FOUND)


def _show(reader: CheckpointReader, checkpoint: str, as_json: bool, shards: bool) -> None:
    m = reader.manifest
    if reader.locator is not None:
        import dataclasses

        m = dataclasses.replace(m, rng=reader.locator.trees("rng"), data=reader.locator.trees("data"))
    if as_json:
        doc = json.loads(m.to_json())  # the in-memory manifest, every chunk in place (v2: its indexes read)
        doc["format_version"] = m.format_version
        if not shards:
            for t in doc["tensors"].values():
                t["shards"] = len(t["shards"])
        click.echo(json.dumps(doc, indent=2))
        return
    out.print(
        f"{checkpoint}  step {m.step}  {m.backend}  {layout_text(m.layout)}  "
        f"{human_bytes(m.total_bytes)} in {count(len(m.files), 'file')}  (format v{m.format_version}, {m.created_at})",
        markup=False,
    )
    rows = []
    for name, t in m.tensors.items():
        rows.append(
            [
                name,
                t.role + (f" ({t.key})" if t.key else ""),
                str(list(t.shape)),
                t.dtype,
                str(len(t.shards)) if reader.locator is None else count(m.v2.pieces[name].count, "piece"),
                human_bytes(t.nbytes),
            ]
        )
        if shards:
            for sh in t.shards:
                rows.append(
                    [
                        f"  {sh.file}@{sh.offset}",
                        sh.codec,
                        f"{list(sh.box.offsets)}+{list(sh.box.lengths)}",
                        "",
                        "",
                        human_bytes(sh.nbytes),
                    ]
                )
    cols = [Col("tensor", name=True), Col("role", fold=True), Col("shape"), Col("dtype"), Col("shards", "right"),
            Col("size", "right")]  # fmt: skip
    print_table(out, cols, rows)
    if m.optimizer:
        out.print(
            f"optimizer: {m.optimizer['type']}, {count(len(m.optimizer['param_groups']), 'param group')}",
            markup=False,
        )
    for label, value in (("scheduler", m.scheduler), ("scaler", m.scaler)):
        if value is not None:
            out.print(
                f"{label}: {', '.join(sorted(value)) if isinstance(value, dict) else value}", markup=False
            )
    out.print(f"progress: {m.progress}", markup=False)
    acc = m.extra.get("accelerate") if isinstance(m.extra, dict) else None
    if isinstance(acc, dict) and acc.get("sampler") is not None:  # an accelerate sampler.bin, converted
        from ckpt.converters.accelerate_sampler import describe

        out.print(f"sampler: {describe(acc['sampler'])}", markup=False)
    if m.rng:
        from ckpt.state.rng_rule import plan_across

        carried, derived = plan_across(m.rng, m.rng_base)
        seed = (
            f"base seed {m.rng_base['seed']} ({m.rng_base['source']})"
            if m.rng_base
            else "a derived base seed"
        )
        out.print(
            f"rng: ranks {', '.join(sorted(m.rng, key=int))}; on another DP size: carried "
            f"{', '.join(carried) or 'none'} (shared by every rank), re-derived {', '.join(derived) or 'none'} "
            f"from {seed} + step + rank",
            markup=False,
        )
    if m.data:
        out.print(f"data-loader state: ranks {', '.join(sorted(m.data, key=int))}", markup=False)
    if m.data_position:
        from ckpt.format.data_position import describe

        out.print(f"data position: {describe(m.data_position)}", markup=False)
    if m.tokenizer:
        out.print(
            f"tokenizer: {m.tokenizer.get('name')} sha256 {str(m.tokenizer.get('sha256'))[:16]}", markup=False
        )
    if m.adapter is not None:
        base = m.adapter.get("base") or {}
        if base.get("digest") is None:
            out.print(
                "adapter only: base not recorded (converted adapter; restore does not check it)", markup=False
            )
        else:
            out.print(
                f"adapter only: base {base.get('source') or '(source unknown)'} {base.get('digest')}, "
                f"{count(int(base.get('tensors') or 0), 'tensor')}, {human_bytes(base.get('bytes') or 0)} not stored here",
                markup=False,
            )
    versions = m.environment.get("versions", {})
    out.print("environment: " + ", ".join(f"{k} {v}" for k, v in versions.items()), markup=False)


def _inspect_nxd(doc: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    flags = [k for k in ("xser", "zero1", "legacy", "optimizer", "scheduler", "user_content") if doc[k]]
    out.print(
        f"{doc['path']}  NxD tag {doc['tag']}  step {doc['step']}  {doc['status']}  "
        f"tp={doc['tp']} pp={doc['pp']} dp={doc['dp']} ep={doc['ep']}  {' '.join(flags)}".rstrip(),
        markup=False,
    )
    for p in doc["problems"]:
        out.print(f"problem: {p}", markup=False)
    rows = [[rank, name, str(shape)] for rank, tensors in doc["ranks"].items() for name, shape in tensors]
    print_table(out, [Col("rank"), Col("tensor", name=True), Col("shape")], rows)
    if doc["status"] == "damaged":  # marked done, files missing or torn: as ``ls`` says it
        sys.exit(EXIT_FOUND)
