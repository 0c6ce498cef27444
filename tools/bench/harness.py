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


@dataclass(frozen=True)
class Col:
    """One column: the row's key, its header (default: the key) and how a value is written."""

    key: str
    header: str = ""
    fmt: str | Callable[[Any], str] = "{}"  # str.format spec of the value ("{:.1f}"), or a function

    def cell(self, row: Row) -> str:
        value = row.get(self.key, "")
        if value is None or value == "":
            return "–"
        return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)


@dataclass(frozen=True)
class Table:
    """A markdown table over result[rows] (a list of dicts); title and note are formatted with the result."""

    rows: str
    cols: Sequence[Col] | Callable[[Row], Sequence[Col]]  # or made from the result (columns per RTT, ...)
    title: str = ""  # "## ..." above the table (can be empty)
    note: str = ""  # a paragraph below it (can be empty)
    where: Callable[[Row], bool] | None = None  # only the rows it accepts (None: all)

    def render(self, result: Row) -> list[str]:
        rows = [r for r in result.get(self.rows, []) if self.where is None or self.where(r)]
        cols = self.cols(result) if callable(self.cols) else self.cols
        lines = [self.title.format(**result), ""] if self.title else []
        lines += ["| " + " | ".join(c.header or c.key for c in cols) + " |"]
        lines += ["|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(c.cell(r) for c in cols) + " |" for r in rows]
        return lines + (["", self.note.format(**result)] if self.note else []) + [""]


@dataclass(frozen=True)
class Plot:
    """A PNG over result[rows]: one line (or bar series) per label in ys, split by `group`'s values.

    ys maps a series label to the row key it plots; with `group`, a series per (label, group value)."""

    rows: str
    x: str
    ys: dict[str, str]
    xlabel: str
    ylabel: str
    title: str = ""  # formatted with the result
    group: str = ""  # a row key: a series for each of its values ("" = none)
    kind: str = "line"  # line | bar (bars: one group per row, labelled by x)
    ylim: tuple[float, float] | None = None
    where: Callable[[Row], bool] | None = None  # only the rows it accepts (None: all)

    def series(self, rows: list[Row]) -> list[tuple[str, list[Any], list[Any]]]:
        groups = list(dict.fromkeys(r[self.group] for r in rows)) if self.group else [None]
        out = []
        for g in groups:
            sub = [r for r in rows if not self.group or r[self.group] == g]
            for label, key in self.ys.items():
                name = label if g is None else f"{label}, {self.group} {g}" if label else str(g)
                out.append(
                    (
                        name,
                        [r[self.x] for r in sub if r.get(key) is not None],
                        [r[key] for r in sub if r.get(key) is not None],
                    )
                )
        return out

    def write(self, path: Path, result: Row) -> None:
        from tools.plots import bar_plot, line_plot

        rows = [r for r in result.get(self.rows, []) if self.where is None or self.where(r)]
        title = self.title.format(**result)
        if self.kind == "bar":
            groups = [str(r[self.x]) for r in rows]
            bar_plot(
                path,
                groups,
                {label: [r.get(k) or 0.0 for r in rows] for label, k in self.ys.items()},
                self.ylabel,
                title,
            )
        else:
            line_plot(path, self.series(rows), self.xlabel, self.ylabel, title, self.ylim)


@dataclass(frozen=True)
class Report:
    """What a benchmark writes: <name>.json, <name>.md (title, then each table) and <name>.png."""

    name: str
    title: str  # "# ..." formatted with the result
    tables: Sequence[Table]
    plot: Plot | None = None
    intro: str = "`{command}` ({machine})"  # the line under the title, formatted with the result
    extra: Callable[[Row], list[str]] | None = field(default=None)  # more markdown lines after the tables

    def markdown(self, result: Row) -> str:
        lines = [self.title.format(**result), "", self.intro.format(**result), ""]
        for table in self.tables:
            lines += table.render(result)
        if self.extra is not None:
            lines += self.extra(result)
        return "\n".join(lines).rstrip("\n") + "\n"

    def write(self, out: Path, result: Row) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.name}.json").write_text(json.dumps(result, indent=1, default=str))
        (out / f"{self.name}.md").write_text(self.markdown(result))
        written = [f"{self.name}.json", f"{self.name}.md"]
        if self.plot is not None and result.get(self.plot.rows):
            self.plot.write(out / f"{self.name}.png", result)
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
    result["config"] = config
    report.write(Path(args.out), result)
    return 0 if result.get("exact", True) else 1  # a run whose ids differ from the reference's fails
