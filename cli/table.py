"""Tables for every command: boxed and fitted to a terminal, plain aligned text when piped.

On a terminal a table is at most the terminal's width: a ``name`` column (tensor and file names) is wrapped at
dots (``model.layers.0.`` / ``self_attn.q_proj.weight``), never mid-word, and a ``fold`` column (free text) at
spaces.  Piped (logs, ``grep``, ``awk``), a table is plain text: a header line, then one line per row, columns
separated by two spaces, nothing cut or wrapped, no box characters and no trailing spaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text


@dataclass(frozen=True)
class Col:
    header: str
    justify: str = "left"  # "left" or "right"
    #: a dotted name: on a terminal wrapped at dots to fit
    name: bool = False
    #: free text: on a terminal wrapped at spaces to fit
    fold: bool = False


def plain(cell: Any) -> str:
    """The text of a cell without styles (a :class:`Text`, or anything printable, taken literally)."""
    return cell.plain if isinstance(cell, Text) else str(cell)


def wrap_at_dots(name: str, width: int) -> str:
    """``name`` split into lines of at most ``width`` characters after its dots or slashes (``optim/<param>/key``);
    a longer part stays whole (the table folds it)."""
    import re

    if len(name) <= width:
        return name
    parts = [p for p in re.split(r"(?<=[./])", name) if p]  # each part ends at a dot or slash
    lines, line = [], ""
    for p in parts:
        if line and len(line) + len(p) > width:
            lines.append(line)
            line = ""
        line += p
    lines.append(line)
    return "\n".join(lines)


def _share(room: int, needs: dict[int, int], least: int = 8) -> dict[int, int]:
    """Widths for the flexible columns: what each needs when all fit in ``room``, else fair shares of it
    (a column needing less than its share gives the rest to the others)."""
    widths: dict[int, int] = {}
    left = dict(needs)
    while left:
        share = max(least, room // len(left))
        fits = {i: w for i, w in left.items() if w <= share}
        if not fits:
            widths.update({i: share for i in left})
            break
        widths.update(fits)
        room -= sum(fits.values())
        left = {i: w for i, w in left.items() if i not in fits}
    return widths


def plain_lines(cols: Sequence[Col], rows: Sequence[Sequence[Any]], title: str | None = None) -> list[str]:
    """The piped form: title, header, rows; aligned, two spaces apart, no trailing spaces."""
    text = [[plain(c) for c in row] for row in rows]
    widths = [max([len(col.header)] + [len(r[i]) for r in text]) for i, col in enumerate(cols)]
    out = [title] if title else []
    for row in [[c.header for c in cols], *text]:
        cells = [
            v.rjust(widths[i]) if cols[i].justify == "right" else v.ljust(widths[i])
            for i, v in enumerate(row)
        ]
        out.append("  ".join(cells).rstrip())
    return out


def print_table(
    console: Console, cols: Sequence[Col], rows: Sequence[Sequence[Any]], title: str | None = None
) -> None:
    """Print ``rows`` under ``cols`` on ``console`` (boxed and fitted on a terminal, plain text when piped).

    Cells are :class:`Text` (styled) or anything else, printed literally (a ``[`` in a name is not markup);
    ``title`` is plain text.
    """
    if not console.is_terminal:
        for line in plain_lines(cols, rows, title):
            console.file.write(line + "\n")
        console.file.flush()
        return
    from rich.table import Table

    texts = [[plain(c) for c in row] for row in rows]
    natural = [
        max([len(col.header)] + [len(line) for r in texts for line in r[i].splitlines() or [""]])
        for i, col in enumerate(cols)
    ]
    flex = [i for i, col in enumerate(cols) if col.name or col.fold]
    # each column takes 2 cells of padding, and the box one border per column plus one
    room = console.width - sum(w for i, w in enumerate(natural) if i not in flex) - 3 * len(cols) - 1
    names = {i: natural[i] for i in flex if cols[i].name}
    texts_ = {i: natural[i] for i in flex if not cols[i].name}
    if names and texts_:
        # names first: free text wraps well at spaces, a name only at its dots
        words = {i: max([len(x) for r in texts for x in r[i].split()] or [1]) for i in texts_}
        widths = {i: min(w, max(8, words[i], room // (len(flex) + 1))) for i, w in texts_.items()}
        widths.update(_share(room - sum(widths.values()), names))
    else:
        widths = _share(room, {i: natural[i] for i in flex})
    table = Table(title=Text(title) if title else None, title_justify="left")
    for i, col in enumerate(cols):
        table.add_column(
            col.header,
            justify=col.justify,  # type: ignore[arg-type]
            overflow="fold",
            no_wrap=i not in flex,
            min_width=widths.get(i),
            max_width=widths.get(i),
        )
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            if cols[i].name:
                cell = wrap_at_dots(plain(cell), widths[i])
            cells.append(cell if isinstance(cell, Text) else Text(str(cell)))
        table.add_row(*cells)
    console.print(table)
