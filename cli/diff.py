"""``ckpt diff A B``: two checkpoints in any formats, compared tensor by tensor (:mod:`ckpt.converters.diff`).

Thin: parses flags, shows a progress bar on a terminal, prints what differs (or ``--json``).  Exit codes: 0 equal
(within ``--atol``/``--rtol``), 1 different, 2 bad input.
"""

from __future__ import annotations

from typing import Any

import click

from .common import err, human_bytes, out

EPILOG = """\b
Examples:
  ckpt diff run/step_1000 out/hf --config out/hf/config.json    # an NxD tag against the HF model made from it
  ckpt diff out/cuda hf_model/ --atol 1e-6 --rtol 1e-5
  ckpt diff run/checkpoints/step_00000010 run/checkpoints/step_00000030 --json
  ckpt diff hf_out/checkpoint-20 hf_out/checkpoint-40

\b
Formats: ours, HF folders, HF Trainer checkpoint-N folders, accelerate save_state folders, DCP, NxD tags (--config), PEFT adapters, NxD LoRA tags.
Tensors are compared in the full (unsharded, HF-named) view, one pair at a time. Element x of A matches y of B when
|x - y| <= atol + rtol * |y| (default: bit equality). Exit codes: 0 equal, 1 different (or damaged),
2 cannot run (bad input, unsupported format).
"""

#: rows printed for each list before "... and N more" (``--json`` has them all)
SHOWN = 20


@click.command("diff", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a")
@click.argument("b")
@click.option("--config", "config_path", help="HF config.json for an NxD tag (either side).")
@click.option("--config-b", "config_b_path", help="HF config.json for B when it differs from A's.")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--allow-unmarked", is_flag=True, help="Read an NxD training tag whose save never wrote 'done'.")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def diff(
    a: str,
    b: str,
    config_path: str | None,
    config_b_path: str | None,
    atol: float,
    rtol: float,
    allow_unmarked: bool,
    show_all: bool,
    as_json: bool,
) -> None:
    """Compare checkpoints A and B tensor by tensor: values, names, shapes, dtypes, optimizer state, step (and an
    accelerate sampler's seed, epoch and generator)."""
    from ckpt.converters.diff import diff as run_diff
    from ckpt.converters.engine.allocator import pin_malloc
    from ckpt.converters.options import load_config

    from ckpt.errors import CkptError

    if atol < 0 or rtol < 0:
        raise CkptError(f"--{'atol' if atol < 0 else 'rtol'}: expected a tolerance >= 0")
    pin_malloc()  # as convert: freed tensors go back to the OS, so a long diff does not creep up
    result = _run(
        run_diff,
        a,
        b,
        config=load_config(config_path),
        config_b=load_config(config_b_path),
        atol=atol,
        rtol=rtol,
        allow_unmarked=allow_unmarked,
    )
    if as_json:
        import json

        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print(result, show_all)
    raise click.exceptions.Exit(result.exit_code)


def _run(run_diff: Any, a: str, b: str, **kw: Any) -> Any:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("comparing"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,  # a bar only on a terminal, as convert
    ) as bar:
        task = bar.add_task("diff", total=None)
        return run_diff(
            a,
            b,
            progress=lambda n: bar.advance(task, n),
            on_plan=lambda n: bar.update(task, total=n),
            **kw,
        )


def _listed(title: str, names: list[str]) -> None:
    if not names:
        return
    out.print(f"{title} ({len(names)}):", markup=False)
    for n in names[:SHOWN]:
        out.print(f"  {n}", markup=False)
    if len(names) > SHOWN:
        out.print(f"  ... and {len(names) - SHOWN} more (--json lists all)", markup=False)


def _print(r: Any, show_all: bool) -> None:
    out.print(f"A: {r.a} [{r.format_a}]", markup=False)
    out.print(f"B: {r.b} [{r.format_b}]", markup=False)
    changed = r.changed
    rows = r.tensors if show_all else changed
    for t in rows[: None if show_all else SHOWN]:
        out.print(f"  {'=' if t.within else '!'} {t.name}: {t.what}", markup=False)
    if not show_all and len(changed) > SHOWN:
        out.print(f"  ... and {len(changed) - SHOWN} more (--json lists all)", markup=False)
    _listed("only in A", r.only_a)
    _listed("only in B", r.only_b)
    if r.steps_differ:
        out.print(f"step: {r.step_a} -> {r.step_b}", markup=False)
    for line in r.state:
        out.print(line, markup=False)
    out.print(f"optimizer state: {r.optimizer}", markup=False)
    for note in r.notes:
        out.print(f"note: {note}", markup=False)
    nbytes = sum(_nbytes(t) for t in r.tensors)
    tol = f" (atol {r.atol:g}, rtol {r.rtol:g})" if r.atol or r.rtol else ""
    equal = sum(t.equal for t in r.tensors)
    close = sum(t.within and not t.equal for t in r.tensors)
    verdict = "equal" if r.same else "different"
    out.print(
        f"{verdict}{tol}: {len(r.tensors)} tensors compared ({human_bytes(nbytes)}): {equal} equal"
        + (f", {close} within tolerance" if close else "")
        + f", {len(changed)} changed, {len(r.only_a)} only in A, {len(r.only_b)} only in B",
        markup=False,
    )


def _nbytes(t: Any) -> int:
    from ckpt.format.dtypes import dtype_from_name

    n = 1
    for s in t.shape_b:
        n *= s
    return n * dtype_from_name(t.dtype_b).itemsize
