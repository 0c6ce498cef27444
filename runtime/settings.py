"""Configuration declared once: dataclass fields (type, default, help) -> flags, TOML reader, errors, reference.

Both processes declare their configuration as a tree of dataclasses whose fields are made with
`setting(default, help=..., choices=..., flag=...)`. Everything else is derived here, by the field
names, never copied field by field (STYLE.md 5):

    add_flags(parser, cls)      one argparse flag per field (`--max-sessions`; `flag=` renames it)
    defaults(**values)          a subclass's own defaults for settings a base class declares
    build(cls, data, name)      a TOML table -> the dataclass: unknown keys and wrong types named
    build_tree(cls, data)       TOML sections -> the root dataclass of section dataclasses
    check_choices(obj, prefix)  the declared choices, from a dataclass's `__post_init__`
    reference(cls, ...)         the markdown table of the configuration reference page

Stdlib only: `agent/` and `server_bridge/` both import it and neither imports the other.
"""

from __future__ import annotations

try:
    import tomllib  # novm: 3.11+, with the fallback below (CI: vermin)
except ImportError:  # Python 3.10 (JetPack 6, ROS 2 Humble): the same parser, as a package
    import tomli as tomllib
import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "add_flags",
    "build",
    "build_tree",
    "check_choices",
    "defaults",
    "flag_name",
    "help_of",
    "load_toml",
    "parse_value",
    "reference",
    "setting",
    "tomllib",
]


class ConfigError(ValueError):
    """A configuration that is refused; the message names the key and says what it must be."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | None = None,
    choices: Sequence[Any] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field with its help, and optionally its choices (checked by `check_choices`, offered by
    argparse), its flag's name when it is not `--the-field-name`, a metavar, a parser for the flag's text
    (`parse`) and, for a list, `repeat` (the flag given once per item instead of comma-separated)."""
    meta: dict[str, Any] = {"help": help, "choices": tuple(choices) if choices is not None else None, "flag": flag}
    meta.update(metavar=metavar, parse=parse, repeat=repeat)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def defaults(**values: Any) -> Callable[[type], type]:
    """A class decorator, under @dataclass: the class's own defaults for settings one of its bases declares.
    The declaration (type, help, choices, flag) stays the base's, so a setting several commands share is
    declared once (`class ProfileConfig(EngineSettings)` with `@defaults(threads=1)`)."""

    def wrap(cls: type) -> type:
        bases = [b for b in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(b)]  # the nearest last: it wins
        declared = {f.name: f for base in bases for f in dataclasses.fields(base)}
        own = cls.__dict__.get("__annotations__", {})
        for name, value in values.items():
            if name not in declared:
                raise TypeError(f"{cls.__name__}: no base declares a setting {name!r}")
            base = declared[name]
            own[name] = base.type
            setattr(cls, name, dataclasses.field(default=value, metadata=base.metadata))
        cls.__annotations__ = own
        return cls

    return wrap


# ------------------------------------------------------------------ types


def _unwrap(typ: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); X -> (X, False)."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return typ, False


def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(typ: Any) -> Any:
    """int, float, str, bool, list or dict: what a value of this field is."""
    inner, _ = _unwrap(typ)
    return typing.get_origin(inner) or inner


def _item(typ: Any) -> Any:
    """The item type of `list[X]` (str when undeclared)."""
    args = typing.get_args(_unwrap(typ)[0])
    return args[0] if args else str


def type_name(typ: Any) -> str:
    inner, optional = _unwrap(typ)
    base = typing.get_origin(inner) or inner
    name = {list: f"list of {_item(inner).__name__}", dict: "table"}.get(base, getattr(base, "__name__", str(base)))
    return f"{name} or unset" if optional else name


def _is(value: Any, typ: Any) -> bool:
    """A TOML value of this field's type; int and float take each other (a range check says more)."""
    inner, optional = _unwrap(typ)
    if value is None:
        return optional
    base = typing.get_origin(inner) or inner
    if base in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is list:
        return isinstance(value, list) and all(_is(v, _item(inner)) for v in value)
    return isinstance(value, base) if isinstance(base, type) else True


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def help_of(f: dataclasses.Field[Any], notes: Mapping[str, str] | None = None) -> str:
    """The field's declared help; `notes` for a dataclass declared elsewhere without `setting`."""
    return f.metadata.get("help") or (notes or {}).get(f.name, "")


# ------------------------------------------------------------------ reading


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        table: dict[str, Any] = tomllib.loads(Path(path).read_text())
        return table
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None


def parse_value(raw: str) -> Any:
    """A command line's value, read as TOML (`0.3`, `true`, `"sim"`, `{a = 1}`); else the bare string."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def build(cls: type, values: Mapping[str, Any], name: str) -> Any:
    """The table `[name]` as `cls`: its keys must be fields and their values of the fields' types."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"[{name}] has no field(s) {sorted(unknown)}; known: {sorted(known)}")
    hints = _types(cls)
    for key, value in values.items():
        if not _is(value, hints[key]):
            raise ConfigError(f"{name}.{key} must be {type_name(hints[key])}, got {value!r}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{name}]: {e}") from None


def build_tree(cls: type, data: Mapping[str, Any]) -> Any:
    """TOML sections -> `cls`, whose fields are the sections' dataclasses (each built by `build`)."""
    sections = {f.name: type(default_of(f)) for f in dataclasses.fields(cls)}
    unknown = set(data) - set(sections)
    if unknown:
        raise ConfigError(f"unknown config section(s) {sorted(unknown)}; known: {sorted(sections)}")
    for name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {values!r}")
    return cls(**{name: build(sections[name], values, name) for name, values in data.items()})


def check_choices(obj: Any, prefix: str = "") -> None:
    """Every field declared with choices holds one of them (call it from `__post_init__`)."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(obj, f.name) not in choices:
            raise ConfigError(
                f"{prefix}{f.name} must be one of {', '.join(map(str, choices))}, got {getattr(obj, f.name)!r}"
            )


# ------------------------------------------------------------------ flags


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _split(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def split(text: str) -> list[Any]:
        try:
            return [item(t.strip()) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return split


def _flag_options(f: dataclasses.Field[Any], typ: Any, overriding: bool) -> dict[str, Any]:
    """argparse's keyword arguments for one field; `overriding`: absent flags leave the file's value."""
    base, meta = _base(typ), f.metadata
    options: dict[str, Any] = {"dest": f.name}
    if base is bool:
        options["action"] = argparse.BooleanOptionalAction if overriding or default_of(f) else "store_true"
    elif base is list and meta.get("repeat"):
        options.update(action="append", type=_item(typ))
    elif base is list:
        options["type"] = meta.get("parse") or _split(_item(typ))
    else:
        options["type"] = meta.get("parse") or _unwrap(typ)[0]
    if meta.get("choices") is not None:
        options["choices"] = meta["choices"]
    if meta.get("metavar"):
        options["metavar"] = meta["metavar"]
    if overriding:
        options["default"] = argparse.SUPPRESS
    elif _has_default(f):
        options["default"] = default_of(f)
    else:
        options["required"] = True
    return options


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    overriding: bool = False,
    notes: Mapping[str, str] | None = None,
    only: Iterable[str] | None = None,
) -> None:
    """One flag per field of `cls` (or of those named in `only`, the fields with a declared `flag`).
    overriding: a flag not given is absent from the namespace (the config file's value stands);
    else it is the field's default, and a field without one is a required flag."""
    hints, wanted = _types(cls), set(only) if only is not None else None
    for f in dataclasses.fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        shown = _has_default(f) and default_of(f) is not None
        default = f" (default: {toml_value(default_of(f))})" if shown else ""
        text = (help_of(f, notes) + default).replace("%", "%%")
        parser.add_argument(flag_name(f), help=text, **_flag_options(f, hints[f.name], overriding))


def given(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that the command line set (flags added with overriding=True)."""
    return {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}


# ------------------------------------------------------------------ the reference page


def toml_value(value: Any) -> str:
    """A value as a TOML file writes it ("unset" for None, which TOML cannot write)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def reference(
    cls: type, *, flags: str = "none", keys: bool = True, notes: Mapping[str, str] | None = None
) -> list[str]:
    """The markdown table of `cls`'s fields: key, flag (flags "all": every field's; "declared": those
    declared with `flag=`; "none"), type, default, help and choices."""
    hints = _types(cls)
    head = (["key"] if keys else []) + (["flag"] if flags != "none" else []) + ["type", "default", "what it is"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in dataclasses.fields(cls):
        text = help_of(f, notes)
        if f.metadata.get("choices") is not None:
            text += " One of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
        default = f"`{toml_value(default_of(f))}`" if _has_default(f) else "required"
        flag = flag_name(f) if flags == "all" else f.metadata.get("flag") or ""
        cells = ([f"`{f.name}`"] if keys else []) + ([f"`{flag}`" if flag else ""] if flags != "none" else [])
        cells += [type_name(hints[f.name]), default, text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def version() -> str:
    """This installation's version (setup.py's), for both CLIs' --version."""
    from importlib import metadata

    try:
        return metadata.version("edgespec")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0.1.0+checkout"
