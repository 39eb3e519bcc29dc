"""``ckpt compare --plot out.png``: loss of both runs, their difference in the tolerance band, and both LRs.

Drawn with the headless Agg backend so it works on clusters without a display; matplotlib is an optional
dependency (``pip install ckpt[plot]``) imported only when a plot is drawn.
"""

from __future__ import annotations

import math
import os

from ckpt.resume.compare import Comparison
from ckpt.resume.compare_report import fmt
from ckpt.resume.errors import RunInputError


def plot_comparison(c: Comparison, out: str | os.PathLike[str]) -> None:
    """Loss of both runs, their difference with the tolerance band below, and both LRs: one PNG, drawn with
    the headless Agg backend so it works on clusters without a display."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RunInputError("--plot needs matplotlib: pip install 'ckpt[plot]'") from None
    colour_a, colour_b = "#1f77b4", "#ff7f0e"
    fig, (ax_loss, ax_diff, ax_lr) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.6]}
    )
    for side, colour, lw, alpha in ((c.a, colour_a, 2.4, 0.55), (c.b, colour_b, 1.0, 1.0)):
        steps = sorted(side.curve)
        for ax, attr in ((ax_loss, "loss"), (ax_lr, "lr")):
            pts = [
                (s, getattr(side.curve[s], attr)) for s in steps if getattr(side.curve[s], attr) is not None
            ]
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], color=colour, lw=lw, alpha=alpha, label=side.label
            )
    xs, ds = c.diff_series()
    ax_diff.plot(xs, ds, color="#444444", lw=0.9, label=f"{c.b.label} - {c.a.label}")
    s = c.loss
    if math.isfinite(s.tolerance):
        ax_diff.axhspan(-s.tolerance, s.tolerance, color="green", alpha=0.10, lw=0, label="tolerance")
    ax_diff.axhline(0, color="grey", lw=0.6)
    div = set(s.diverging)
    pts = [(x, d) for x, d in zip(xs, ds, strict=True) if x in div]
    if pts:
        ax_diff.scatter(
            [p[0] for p in pts], [p[1] for p in pts], color="red", s=10, zorder=3, label="diverging"
        )
    biggest = max((abs(d) for d in ds if math.isfinite(d)), default=0.0)
    if 0 < biggest < 0.25 * s.tolerance:
        # Zoom in on a difference far inside the band, or the panel shows a flat line at zero.
        ax_diff.set_ylim(-1.4 * biggest, 1.4 * biggest)
        ax_diff.annotate(
            f"tolerance +/-{s.tolerance:.3g} is off this scale",
            (0.01, 0.04),
            xycoords="axes fraction",
            fontsize=8,
            color="green",
        )
    if c.drift.window and xs:
        lo = xs[-min(c.drift.window, len(xs))]
        ax_diff.axvspan(
            lo, xs[-1], color="grey", alpha=0.08, lw=0, label=f"drift window ({c.drift.window} steps)"
        )
        ax_diff.hlines(c.drift.last, lo, xs[-1], color="purple", lw=1.6, label=f"drift {c.drift.last:+.3g}")
    for ax, step, text in (
        (ax_loss, s.first_divergence, "loss diverges"),
        (ax_diff, s.first_divergence, ""),
        (ax_lr, c.lr.first_mismatch, "LR differs"),
        (ax_loss, c.data.first_mismatch, "data differs"),
    ):
        if step is not None:
            ax.axvline(step, color="red", ls=":", lw=0.9)
            if text:
                ax.annotate(
                    f"{text} @ {step}",
                    (step, 0.97),
                    xycoords=("data", "axes fraction"),
                    fontsize=8,
                    va="top",
                    ha="left",
                    color="red",
                )
    verdict = (
        f"agree (max |{c.b.label} - {c.a.label}| {fmt(s.max_abs_diff, '.3g')}, tolerance {fmt(s.tolerance, '.3g')})"
        if c.agree
        else "diverge: " + "; ".join(c.problems)
    )
    ax_loss.set_title(f"{c.b.label} vs {c.a.label}: {verdict}", fontsize=10, loc="left", wrap=True)
    ax_loss.set_ylabel("loss")
    ax_diff.set_ylabel("loss difference")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    for ax in (ax_loss, ax_diff, ax_lr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise RunInputError(f"cannot write plot {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
