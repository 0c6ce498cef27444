"""One PNG line plot for the tools' reports (bench, exit training); matplotlib without a display."""
from __future__ import annotations

from pathlib import Path


def line_plot(path: Path, series: list[tuple[str, list, list]], xlabel: str, ylabel: str, title: str = "",
              ylim: tuple[float, float] | None = None, notes: list[tuple[float, float, str]] = ()) -> None:
    """series: (label, xs, ys) per line; notes: (x, y, text) annotations beside points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=label)
    for x, y, text in notes:
        ax.annotate(text, (x, y), fontsize=7, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
