"""One PNG line plot for the tools' reports (bench, exit training); matplotlib without a display."""

from __future__ import annotations

from pathlib import Path


def line_plot(
    path: Path,
    series: list[tuple[str, list, list]],
    xlabel: str,
    ylabel: str,
    title: str = "",
    ylim: tuple[float, float] | None = None,
    notes: list[tuple[float, float, str]] = (),
) -> None:
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


def bar_plot(path: Path, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str = "") -> None:
    """Grouped bars: one group per label in `groups`, one bar per series (name -> a value per group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (name, ys) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, ys, width, label=name)
    ax.set_xticks(x, groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
