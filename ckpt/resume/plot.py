"""``--plot out.png``: loss and LR around each resume boundary, pre-crash and resumed sessions in two colours.

Drawn with the headless Agg backend so it works on clusters without a display; matplotlib is an optional
dependency (``pip install ckpt[plot]``) imported only here.
"""

from __future__ import annotations

import os

from ckpt.resume.errors import RunInputError
from ckpt.resume.verify import Verification

PRE_COLOUR = "#1f77b4"
POST_COLOUR = "#ff7f0e"


def check_plot_path(out: str | os.PathLike[str]) -> None:
    """Refuse, before any work, a ``--plot`` path whose extension matplotlib cannot write (it would fail
    only after the verification, with a traceback)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise RunInputError("--plot needs matplotlib: pip install 'ckpt[plot]'") from None
    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = os.path.splitext(os.fspath(out))[1].lstrip(".").lower()
    if ext not in kinds:
        raise RunInputError(
            f"--plot {os.fspath(out)}: expected a file ending in one of {', '.join('.' + k for k in kinds)}"
        )


def plot_verification(result: Verification, out: str | os.PathLike[str], window: int = 50) -> None:
    """One row per boundary (at most 6), loss on the left and LR on the right, ``window`` steps each side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RunInputError("--plot needs matplotlib: pip install 'ckpt[plot]'") from None
    verdicts = result.verdicts[:6]
    rows = max(1, len(verdicts))
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.2 * rows), squeeze=False)
    if not verdicts:
        steps = [r for s in result.run.sessions for r in s.steps]
        axes[0][0].plot([r.step for r in steps], [r.loss for r in steps], color=PRE_COLOUR, lw=1)
        axes[0][1].plot([r.step for r in steps], [r.lr for r in steps], color=PRE_COLOUR, lw=1)
        axes[0][0].set_title("loss (no resume boundary)")
        axes[0][1].set_title("learning rate")
    for row, v in zip(axes, verdicts, strict=False):
        b = v.boundary
        n = b.restored_step
        post = b.post.steps[: window + len(b.overlap)]
        hi = post[-1].step if post else n
        crash = b.crash_step if b.crash_step is not None else n
        lo = n - window
        pre = [b.pre[s] for s in sorted(b.pre) if lo <= s <= max(hi, crash)]
        causes = ", ".join(c.value for c in v.causes) or "continuous"
        for ax, attr, label in ((row[0], "loss", "loss"), (row[1], "lr", "learning rate")):
            xs = [r.step for r in pre if getattr(r, attr) is not None]
            ys = [getattr(r, attr) for r in pre if getattr(r, attr) is not None]
            ax.plot(xs, ys, color=PRE_COLOUR, lw=2.4, alpha=0.55, label="before the crash")
            xs = [r.step for r in post if getattr(r, attr) is not None]
            ys = [getattr(r, attr) for r in post if getattr(r, attr) is not None]
            ax.plot(xs, ys, color=POST_COLOUR, lw=1.0, label="after the resume")
            if crash > n:
                ax.axvspan(n, crash, color="grey", alpha=0.08, lw=0)
            ax.axvline(n, color="grey", ls="--", lw=0.8)
            ax.annotate(f"restored {n}", (n, 1.0), xycoords=("data", "axes fraction"), fontsize=8, va="top")
            if crash != n:
                ax.axvline(crash, color="red", ls=":", lw=0.8)
                ax.annotate(
                    f"crash {crash}", (crash, 0.9), xycoords=("data", "axes fraction"), fontsize=8, va="top"
                )
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        row[0].set_title(f"boundary {b.index}: {v.status.value} ({causes})", fontsize=10, loc="left")
        row[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
