"""What every benchmark shares: its common flags, core pinning, timing, exactness checks, and the
JSON, markdown table and PNG plot it writes from the columns it declares.

A benchmark module holds only what it measures:

    REPORT = Report("engine", "# Pass cost ({target})", [Table("grid", [Col("sessions"), Col("ms", "{:.1f}")])],
                    Plot("grid", x="sessions", ys={"pass time": "ms"}, xlabel="sessions", ylabel="ms"))

    def measure(args) -> dict:          # the flags parsed, the process pinned to --cores
        return {"target": ..., "grid": [...]}

    def main(argv=None) -> int:
        return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/engine")

harness.main adds --out, --repeats, --cores and --quick, pins, runs `measure`, then writes
<out>/<name>.json (the result with the command, machine and every flag), <name>.md and <name>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def get(row: Row, key: str) -> Any:
    """row[key]; a dotted key the row does not hold reads into nested dicts ("violation_rate_by_class.8");
    None where absent. A key that holds a dot itself ("d, T 0.7") is found as it is first."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


@dataclass(frozen=True)
class Col:
    """One column: the row's key (dotted: nested), its header (default: the key) and how a value is written."""

    key: str
    header: str = ""
    fmt: str | Callable[[Any], str] = "{}"  # str.format spec of the value ("{:.1f}"), or a function

    def cell(self, row: Row) -> str:
        value = get(row, self.key)
        if value is None or value == "":
            return "–"
        return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)


def pct(value: float) -> str:
    """A rate as a percentage cell: 0.05 -> '5.0 %'."""
    return f"{100 * value:.1f} %"


@dataclass(frozen=True)
class Table:
    """A markdown table over result[rows] (a list of dicts); title and note are formatted with the result.

    With `facet`, one table per value of that row key, its title formatted with {facet: value} too."""

    rows: str | Callable[[Row], list[Row]]  # result[rows], or rows made from the result
    cols: Sequence[Col] | Callable[[Row], Sequence[Col]]  # or made from the result (columns per RTT, ...)
    title: str = ""  # "## ..." above the table (can be empty)
    note: str = ""  # a paragraph below it (can be empty)
    where: Callable[[Row], bool] | None = None  # only the rows it accepts (None: all)
    facet: str = ""  # a row key: a table for each of its values ("" = one table)

    def render(self, result: Row) -> list[str]:
        rows = select(result, self.rows, self.where)
        cols = self.cols(result) if callable(self.cols) else self.cols
        lines: list[str] = []
        for value, sub in facets(rows, self.facet):
            fields = {**result, self.facet: value} if self.facet else result
            lines += [self.title.format(**fields), ""] if self.title else []
            lines += ["| " + " | ".join(c.header or c.key for c in cols) + " |"]
            lines += ["|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(c.cell(r) for c in cols) + " |" for r in sub]
            lines += [""]
        return lines + ([self.note.format(**result), ""] if self.note else [])


def select(result: Row, rows: str | Callable[[Row], list[Row]], where: Callable[[Row], bool] | None) -> list[Row]:
    """The rows a table or plot shows: result[rows] (or rows(result)), those `where` accepts."""
    got = rows(result) if callable(rows) else result.get(rows) or []
    return [r for r in got if where is None or where(r)]


def facets(rows: list[Row], key: str) -> list[tuple[Any, list[Row]]]:
    """(value, its rows) for each value of row[key] in order of appearance; [(None, rows)] without a key."""
    if not key:
        return [(None, rows)]
    return [(v, [r for r in rows if r.get(key) == v]) for v in dict.fromkeys(r.get(key) for r in rows)]


@dataclass(frozen=True)
class Plot:
    """A panel over result[rows]: one line (or bar series) per label in ys, split by `group`'s values.

    ys maps a series label to the row key it plots (dotted: nested), or is made from the result;
    with `group`, a series per (label, group value). With `facet`, a panel per value of that key."""

    rows: str | Callable[[Row], list[Row]]  # result[rows], or rows made from the result
    x: str
    ys: dict[str, str] | Callable[[Row], dict[str, str]]
    xlabel: str
    ylabel: str
    title: str = ""  # formatted with the result (and {facet: value})
    group: str = ""  # a row key: a series for each of its values ("" = none)
    kind: str = "line"  # line | bar (bars: one group per row, labelled by x)
    ylim: tuple[float, float] | None = None
    where: Callable[[Row], bool] | None = None  # only the rows it accepts (None: all)
    facet: str = ""  # a row key: a panel (a row of the figure) for each of its values
    hline: float | None = None  # a dotted horizontal line (a bound) at this y
    xscale: str = "linear"  # or "log" (matplotlib's names)
    yscale: str = "linear"

    def labels(self, result: Row) -> dict[str, str]:
        return self.ys(result) if callable(self.ys) else self.ys

    def series(self, rows: list[Row], ys: dict[str, str] | None = None) -> list[tuple[str, list[Any], list[Any]]]:
        ys = self.labels({}) if ys is None else ys
        out = []
        for g, sub in facets(rows, self.group):
            for label, key in ys.items():
                name = label if g is None else f"{label}, {self.group} {g}" if label else str(g)
                kept = [r for r in sub if get(r, key) is not None]
                out.append((name, [r[self.x] for r in kept], [get(r, key) for r in kept]))
        return out

    def panels(self, result: Row) -> list[tuple[str, list[Row]]]:
        """(title, rows) of each panel this plot draws."""
        rows = select(result, self.rows, self.where)
        return [
            (self.title.format(**({**result, self.facet: v} if self.facet else result)), sub)
            for v, sub in facets(rows, self.facet)
        ]

    def draw(self, ax: Any, title: str, rows: list[Row], result: Row) -> None:
        ys = self.labels(result)
        if self.kind == "bar":
            width = 0.8 / max(1, len(ys))
            for i, (label, key) in enumerate(ys.items()):
                xs = [j + (i - (len(ys) - 1) / 2) * width for j in range(len(rows))]
                ax.bar(xs, [get(r, key) or 0.0 for r in rows], width, label=label)
            ax.set_xticks(range(len(rows)), [str(r[self.x]) for r in rows], fontsize=8)
        else:
            for label, xs, vals in self.series(rows, ys):
                ax.plot(xs, vals, marker="o", label=label)
            ax.set_xlabel(self.xlabel)
        if self.hline is not None:
            ax.axhline(self.hline, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xscale(self.xscale)
        ax.set_yscale(self.yscale)
        if self.ylim:
            ax.set_ylim(*self.ylim)
        ax.set_ylabel(self.ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    def write(self, path: Path, result: Row) -> None:
        write_png(path, [self], result)


def write_png(path: Path, plots: Sequence[Plot], result: Row) -> None:
    """One PNG: the plots side by side, a row of panels per facet value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [p.panels(result) for p in plots]
    nrows = max(len(c) for c in columns)
    fig, axes = plt.subplots(nrows, len(plots), figsize=(7 * len(plots), 4.2 * nrows), squeeze=False)
    for j, (plot, panels) in enumerate(zip(plots, columns, strict=True)):
        for i in range(nrows):
            if i < len(panels):
                plot.draw(axes[i][j], *panels[i], result)
            else:
                axes[i][j].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class Report:
    """What a benchmark writes: <name>.json, <name>.md (title, then each table) and <name>.png (its plots)."""

    name: str
    title: str  # "# ..." formatted with the result
    tables: Sequence[Table]
    plot: Plot | Sequence[Plot] | None = None  # several: panels side by side in the one PNG
    intro: str | Callable[[Row], str] = "`{command}` ({machine})"  # the line under the title
    extra: Callable[[Row], list[str]] | None = field(default=None)  # more markdown lines after the tables

    def markdown(self, result: Row) -> str:
        intro = self.intro(result) if callable(self.intro) else self.intro.format(**result)
        lines = [self.title.format(**result), "", intro, ""]
        for table in self.tables:
            lines += table.render(result)
        if self.extra is not None:
            lines += self.extra(result)
        return "\n".join(lines).rstrip("\n") + "\n"

    def plots(self) -> list[Plot]:
        return [] if self.plot is None else [self.plot] if isinstance(self.plot, Plot) else list(self.plot)

    def write(self, out: Path, result: Row) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.name}.json").write_text(json.dumps(result, indent=1, default=str))
        (out / f"{self.name}.md").write_text(self.markdown(result))
        written = [f"{self.name}.json", f"{self.name}.md"]
        plots = [p for p in self.plots() if select(result, p.rows, p.where)]
        if plots:
            write_png(out / f"{self.name}.png", plots, result)
            written.append(f"{self.name}.png")
        print(f"wrote {out}/: {', '.join(written)}", flush=True)


def pivot(rows: list[Row], keys: Sequence[str], column: str, value: str) -> list[Row]:
    """Long rows to wide: one row per distinct `keys`, with row[f"{value}@{c}"] for each value c of `column`."""
    wide: dict[tuple, Row] = {}
    for r in rows:
        w = wide.setdefault(tuple(r.get(k) for k in keys), {k: r.get(k) for k in keys})
        w[f"{value}@{r[column]}"] = r[value]
    return list(wide.values())


def cores(spec: str) -> list[int]:
    """'0,2' -> [0, 2]; '' -> no pinning (every core this process may use)."""
    return [int(c) for c in spec.split(",") if c.strip()]


def pin(to: Iterable[int]) -> None:
    """Pin this process (and the threads and children it starts afterwards) to these cores."""
    cpus = set(to)
    if cpus:
        os.sched_setaffinity(0, cpus)


def other_core(busy: int) -> int:
    """A core this process may use other than `busy` (itself where it is the only one)."""
    return next((c for c in sorted(os.sched_getaffinity(0)) if c != busy), busy)


def median_ms(fn: Callable[[], object], repeats: int, warm: int = 1) -> float:
    """fn's median wall time in ms over `repeats` calls, after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def check_exact(what: str, ids: Sequence[int], reference: Sequence[int]) -> None:
    """Speculative output must equal the reference's (AR's) token for token: stop the run where not."""
    if list(ids) != list(reference):
        n = next(
            (i for i, (a, b) in enumerate(zip(ids, reference, strict=False)) if a != b), min(len(ids), len(reference))
        )
        got, want = list(ids)[n : n + 4], list(reference)[n : n + 4]
        raise SystemExit(f"{what}: ids differ from the reference at token {n} ({got} vs {want})")


def floats(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


def ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def names(spec: str) -> list[str]:
    return [x for x in spec.split(",") if x.strip()]


def parser(doc: str | None, out: str, repeats: int = 3, cores_default: str = "") -> argparse.ArgumentParser:
    """The flags every benchmark has; a benchmark adds its own to what this returns."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out, help="folder for the JSON, markdown and PNG")
    ap.add_argument("--repeats", type=int, default=repeats, help="timed repetitions of each point")
    ap.add_argument(
        "--cores", type=cores, default=cores(cores_default), help="cores to pin to, e.g. 1 or 0,1 ('' none)"
    )
    ap.add_argument("--quick", action="store_true", help="the smallest run that checks the script (tests)")
    return ap


def main(
    doc: str | None,
    report: Report,
    measure: Callable[[argparse.Namespace], Row],
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: list[str] | None = None,
    *,
    out: str = "bench_results",
    repeats: int = 3,
    cores_default: str = "",
    module: str = "",
    pin_cores: bool = True,
) -> int:
    """Parse the flags, pin to --cores (unless measure does), run `measure`, log its config, write the report."""
    ap = parser(doc, out, repeats, cores_default)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    if pin_cores:
        pin(args.cores)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    print(f"{report.name}: {json.dumps(config, default=str)}", flush=True)
    result = measure(args)
    name = module or f"tools.bench.{report.name}"
    result.setdefault("command", f"python -m {name} " + " ".join(sys.argv[1:] if argv is None else argv))
    result.setdefault(
        "machine", f"{platform.machine()} {os.cpu_count()} cores, pinned to {sorted(os.sched_getaffinity(0))}"
    )
    result.setdefault("started", time.strftime("%Y-%m-%d %H:%M:%S"))
    flags = {k: v for k, v in vars(args).items() if not k.startswith("_")}  # as measure left them (--quick)
    result["config"] = {**flags, **result.get("config", {})}  # the flags, and what measure adds or resolves
    report.write(Path(args.out), result)
    # a run whose ids differ from the reference's, or that measure marks failed (errors), exits 1
    return 0 if result.get("exact", True) and result.get("ok", True) else 1
