"""docs/reference/cli.md is generated from the argparse parsers of `edge-agent` and `server-bridge`, so the
page cannot drift from the flags: this test fails when it does. Regenerate (one command, after any flag or
subcommand is added): `PYTHONPATH=$PWD .venv/bin/python -m tests.test_docs_cli`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"
REGENERATE = "PYTHONPATH=$PWD .venv/bin/python -m tests.test_docs_cli"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    """What a flag takes: its choices, its metavar or its type; "" for a switch."""
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    if action.metavar:
        return str(action.metavar)
    typ = action.type
    name = getattr(typ, "__name__", "") if typ is not None else "str"
    return {"str": "TEXT", "int": "INT", "float": "NUMBER", "split": "LIST"}.get(name, name.upper() or "VALUE")


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or d == []:
        return ""
    return f"`{d!r}`" if isinstance(d, str) else f"`{d}`"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """A table of the parser's options: flag, value, default, help (with argparse's %(default)s expanded)."""
    formatter = parser._get_formatter()
    rows = ["| flag | value | default | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or not action.option_strings:
            continue
        meaning = formatter._expand_help(action) if action.help else ""
        meaning = re.sub(r"\s*\(default: [^()]*\)$", "", meaning)  # the default has a column of its own
        if action.required:
            meaning = "required. " + meaning
        flags = ", ".join(f"`{s}`" for s in action.option_strings)
        rows.append(f"| {flags} | {_cell(_value(action))} | {_default(action)} | {_cell(meaning)} |")
    return rows


def _program(parser: argparse.ArgumentParser) -> list[str]:
    out = ["", f"## {parser.prog}", "", parser.description or "", "", *_options(parser)]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    for name, command in sub.choices.items():
        out += ["", f"### {parser.prog} {name}", "", _cell(helps.get(name, "")), "", *_options(command)]
    return out


def reference_page() -> str:
    from agent.app.cli import _parser as agent_parser
    from server_bridge.cli import _parser as server_parser

    out = [
        "# CLI reference",
        "",
        "<!-- generated from the argparse parsers (agent/app/cli.py, server_bridge/cli.py) by",
        f"     {REGENERATE} ; do not edit by hand -->",
        "",
        "Every flag of both commands, with what it takes, its default and its meaning, as `--help` prints",
        "them. A flag that sets a configuration key says which (`= --set section.key=...`); every key, with",
        "its type and default, is in the [configuration reference](../guide/configuration.md). Every error",
        "a user can cause is one line on stderr and a non-zero exit (2: a bad flag or value, 3: the verifier,",
        "130: Ctrl-C).",
    ]
    out += _program(agent_parser())
    out += _program(server_parser())
    return "\n".join(out) + "\n"


def test_the_cli_reference_is_the_generated_one():
    assert PAGE.read_text() == reference_page(), f"{PAGE.relative_to(ROOT)} is stale: run {REGENERATE}"


def test_the_reference_names_every_subcommand_and_flag():
    page = reference_page()
    for heading in ("### edge-agent run", "### edge-agent generate", "### server-bridge serve"):
        assert heading in page
    for flag in ("`--scene`", "`--max-wait-s`", "`--quiet`", "`--exit-when-done`", "`--version`", "`--port`"):
        assert flag in page, flag


if __name__ == "__main__":  # regenerate docs/reference/cli.md
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(reference_page())
    print(f"wrote {PAGE.relative_to(ROOT)}")
