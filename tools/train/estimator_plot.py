"""The estimator's fit as a figure: measured against estimated pass times, and the relative error.

    python -m tools.train.estimator_plot [docs/estimator]    # after `server-bridge profile --report docs/estimator`

Reads <folder>/estimator.json (every timed pass, its split and its prediction) and writes estimator.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(path: Path, rows: list[dict], report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    kinds = sorted({r["kind"] for r in rows})
    for colour, kind in enumerate(kinds):
        for split, marker in (("train", "o"), ("test", "x")):
            pts = [r for r in rows if r["kind"] == kind and r["split"] == split]
            ms = [r["ms"] for r in pts]
            style = {"s": 14, "c": f"C{colour}", "marker": marker, "alpha": 0.7}
            if pts:
                ax.scatter(ms, [r["predicted_ms"] for r in pts], label=f"{kind} ({split})", **style)
                ax2.scatter(ms, [100 * (r["predicted_ms"] - r["ms"]) / r["ms"] for r in pts], **style)
    top = max(r["ms"] for r in rows) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    test = report["test"]
    title = f"held-out R² {test['r2']:.3f}, MAPE {test['mape_pct']:.1f} %"
    ax.set(xlabel="measured pass (ms)", ylabel="estimated (ms)", title=title)
    ax.legend(fontsize=7)
    ax2.axhline(0, c="k", lw=0.8)
    ax2.set(xlabel="measured pass (ms)", ylabel="error (%)", title="relative error")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "docs/estimator")
    data = json.loads((folder / "estimator.json").read_text())
    plot(folder / "estimator.png", data["batches"], data["report"])
    print(f"wrote {folder / 'estimator.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
