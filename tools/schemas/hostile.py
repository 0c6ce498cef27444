"""Schemas and grammars built to hurt a compiler: the attacks of issue 50 and a seeded generator of deep, wide and
recursive ones within the caps (protocol/structured.py), for the fuzz test and tools/bench/compile_sandbox.py.

    schema_chain(4000)      a $defs chain, each an anyOf of a $ref to the next and an integer (~270 KB): overflowed
                            LLGuidance's stack and killed the daemon and the verifier with SIGSEGV
    lark_chain(4000)        4,000 chained rules (86 KB): the same through Lark
    lark_alternatives(40000)  one rule of 40,000 string alternatives (520 KB): 2.4 s to compile
    Fuzz(seed).case()       (kind, text) at random: reference chains, nested combinators, long alternations, long
                            and nested regexes, recursion, `%json` in Lark, GBNF repetitions
"""

from __future__ import annotations

import json
import random
from typing import Any

SHAPES = ("anyof", "ref", "allof", "items", "props")
MAX_BYTES = 1 << 20  # protocol/structured.py's MAX_SCHEMA_BYTES


def schema_chain(n: int, shape: str = "anyof") -> str:
    """A schema whose $defs d0 .. dn each lead to the next: through an anyOf beside an integer, a bare $ref, an
    allOf, an array's items, or an object's required property."""
    defs: dict[str, Any] = {}
    for i in range(n):
        nxt: dict[str, Any] = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = {
            "anyof": {"anyOf": [nxt, {"type": "integer"}]},
            "ref": nxt,
            "allof": {"allOf": [nxt]},
            "items": {"type": "array", "items": nxt},
            "props": {"type": "object", "properties": {"a": nxt}, "required": ["a"]},
        }[shape]
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs}, separators=(",", ":"))


def lark_chain(n: int, terminals: bool = False) -> str:
    """n rules (or terminals), each an alternative of the next and a string."""
    name = "T" if terminals else "r"
    lines = [f"start: {name}0"] + [f'{name}{i}: {name}{i + 1} | "a"' for i in range(n)] + [f'{name}{n}: "b"']
    return "\n".join(lines)


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f'r{i} ::= r{i + 1} | "a"' for i in range(n)] + [f'r{n} ::= "b"'])


def lark_alternatives(n: int) -> str:
    """One rule of n string alternatives: slow to compile (40,000: 2.4 s here), within every cap."""
    return "start: " + " | ".join(f'"w{i}"' for i in range(n))


class Fuzz:
    """Random grammars of every kind, reproducible from the seed. Sizes stay within the byte cap; depths, chains and
    repeats go on both sides of the caps, so an answer may be a compile or a refusal, never a crash."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def case(self) -> tuple[str, str]:
        """One (kind, text) of at most MAX_BYTES."""
        while True:
            kind, text = self._case()
            if len(text.encode()) <= MAX_BYTES:
                return kind, text

    def _case(self) -> tuple[str, str]:
        kind = self.rng.choice(("json_schema", "json_schema", "lark", "gbnf", "attack"))
        if kind == "json_schema":
            return kind, json.dumps(self.schema(), separators=(",", ":"))
        if kind == "lark":
            return kind, self.lark()
        if kind == "gbnf":
            return kind, self.gbnf()
        return self.attack()

    def attack(self) -> tuple[str, str]:
        r = self.rng
        n = r.choice((100, 250, 300, 1000, 4000))
        return r.choice(
            (
                ("json_schema", schema_chain(n, r.choice(SHAPES))),
                ("lark", lark_chain(n, terminals=r.random() < 0.3)),
                ("gbnf", gbnf_chain(min(n, 600))),  # GBNF's text is at most 16 KiB on the wire
                ("lark", lark_alternatives(r.choice((100, 5000, 40000)))),
            )
        )

    # ---------------------------------------------------------------- JSON schemas

    def schema(self) -> dict[str, Any]:
        r = self.rng
        n_defs = r.choice((0, 3, 20, 200))
        self._defs = [f"d{i}" for i in range(n_defs)]
        self._budget = r.choice((30, 300, 1500))  # sub-schemas left to make: the text stays well under 1 MiB
        self._past_cap = r.random() < 0.05  # its patterns repeat past MAX_PATTERN_REPEAT
        out: dict[str, Any] = self.node(r.randint(2, 12))
        if n_defs:
            out = {**out, "$defs": {d: self.node(r.randint(1, 6)) for d in self._defs}}
        return out

    def node(self, depth: int) -> dict[str, Any]:
        r = self.rng
        self._budget -= 1
        if depth <= 0 or self._budget <= 0:
            return self.leaf()
        pick = r.random()
        if pick < 0.2 and self._defs:
            return {"$ref": f"#/$defs/{r.choice(self._defs)}"}  # chains and cycles through $defs
        if pick < 0.4:
            key = r.choice(("anyOf", "allOf", "anyOf"))
            return {key: [self.node(depth - 1) for _ in range(r.randint(1, 6))]}
        if pick < 0.6:
            width = r.choice((1, 3, 10, 60))
            props = {f"p{i}": self.node(depth - 1 - r.randint(0, 3)) for i in range(width)}
            required = r.sample(sorted(props), r.randint(0, width))
            return {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": r.random() < 0.3,
            }
        if pick < 0.75:
            arr: dict[str, Any] = {"type": "array", "items": self.node(depth - 1)}
            if r.random() < 0.5:
                arr["minItems"], arr["maxItems"] = 0, r.choice((1, 5, 50))
            return arr
        return self.leaf()

    def leaf(self) -> dict[str, Any]:
        r = self.rng
        pick = r.random()
        if pick < 0.3:
            past = "{1,1500}" if self._past_cap else ""  # past MAX_PATTERN_REPEAT: refused
            return {"type": "string", "pattern": f"^{self.regex(r.randint(1, 4))}{past}$"}
        if pick < 0.45:
            return {"enum": [f"v{i}" for i in range(r.choice((2, 30, 30, 1000)))]}
        if pick < 0.6:
            lo = r.randint(-1000, 1000)
            return {"type": r.choice(("integer", "number")), "minimum": lo, "maximum": lo + r.randint(0, 10**6)}
        if pick < 0.75:
            return {"type": "string", "minLength": r.randint(0, 20), "maxLength": r.randint(20, 900)}
        return {"type": r.choice(("boolean", "null", "string", "integer"))}

    def regex(self, depth: int) -> str:
        """A regex of nested groups, alternations and repeats (some past MAX_PATTERN_REPEAT: refused)."""
        r = self.rng
        if depth <= 0:
            return r.choice(("[a-z]", "[0-9]", "\\d", "x", "[^\\s]", "."))
        parts = [self.regex(depth - 1) for _ in range(r.randint(1, 4))]
        body = "|".join(parts) if r.random() < 0.5 else "".join(parts)
        repeat = r.choice(("", "", "*", "+", "?", f"{{{r.randint(0, 30)}}}", f"{{1,{r.choice((5, 200, 1000))}}}"))
        return f"({body}){repeat}"

    # ---------------------------------------------------------------- Lark and GBNF

    def lark(self) -> str:
        r = self.rng
        n = r.choice((2, 10, 50, 120))
        lines = ["start: r0"]
        for i in range(n):
            alts = [self.lark_expr(i, n, r.randint(0, 5)) for _ in range(r.randint(1, 5))]
            lines.append(f"r{i}: " + " | ".join(alts))
        if r.random() < 0.3:
            lines.append(f"r{n}: %json " + json.dumps(self.schema(), separators=(",", ":")))
        else:
            lines.append(f'r{n}: "end"')
        lines.append(f"WORD: /{self.regex(r.randint(1, 4))}/")
        return "\n".join(lines)

    def lark_expr(self, i: int, n: int, depth: int) -> str:
        r = self.rng
        if depth <= 0:
            pick = r.random()
            if pick < 0.4:
                return f"r{r.randint(i + 1, n)}" if r.random() < 0.8 else f"r{r.randint(0, i)}"  # chains and cycles
            if pick < 0.7:
                return f'"{r.choice(("a", "go", "left", "{", "42"))}"'
            return "WORD"
        inner = " ".join(self.lark_expr(i, n, depth - 1) for _ in range(r.randint(1, 3)))
        return r.choice((f"({inner})", f"[{inner}]", f"({inner})*", f"({inner})+"))

    def gbnf(self) -> str:
        r = self.rng
        n = r.choice((2, 10, 60))
        lines = ["root ::= r0"]
        for i in range(n):
            alts = []
            for _ in range(r.randint(1, 4)):
                ref = f"r{r.randint(i + 1, n)}" if r.random() < 0.8 else f"r{r.randint(0, i)}"
                lit = r.choice(('"a"', "[a-z]", '"go"', "[0-9]{1,3}", f"[a-c]{{0,{r.choice((5, 60, 900))}}}"))
                alts.append(r.choice((f"{lit} {ref}", f"({lit} | {ref})*", lit)))
            lines.append(f"r{i} ::= " + " | ".join(alts))
        lines.append(f'r{n} ::= "end"')
        return "\n".join(lines)
