"""One navigation step in words: the lines `edge-agent run` prints per step and the demo prints too."""

from __future__ import annotations

from typing import Callable

from .navigator import Step


def command_text(c: dict) -> str:
    """A set-point in words: "vx +0.50, wz -0.52", or "zero"."""
    parts = [f"{k} {v:+.2f}" for k, v in c.items() if abs(v) > 1e-9]
    return ", ".join(parts) if parts else "zero"


def step_lines(n: int, rec: Step) -> str:
    """The step's mode and time, what it saw, what it said, the action and the command sent (and why):

    [ 2] VERIFIED         3.3s  sees: red box ahead, 5.2 m away
         says: 'The red box is ahead, so I move forward. The next action is move forward 25 cm.'
         action: forward 25 cm (exact) -> sent vx +0.50; think 2.4s (sd, 22 tokens, tau 4.4)
    """
    d = rec.decode
    if not d:
        dec = "no answer"
    elif d.get("tau"):
        dec = f"{d.get('mode')}, {d.get('tokens')} tokens, tau {d['tau']:.1f}"
    else:
        dec = f"{d.get('mode', '-')}, {d.get('tokens', 0)} tokens"
    mode = {"verified": "VERIFIED", "halted": "HALTED"}.get(rec.mode, f"OFFLINE/{rec.offline_policy}")
    if rec.parse == "refused" and not rec.text:  # held, or no frame: no plan made
        return f"[{n:2d}] {mode:<14} {rec.latency_ms.get('step', 0) / 1e3:5.1f}s  held: {rec.reason or 'no plan'}"
    lines = [
        f"[{n:2d}] {mode:<14} {rec.latency_ms.get('step', 0) / 1e3:5.1f}s  sees: {rec.observation}",
        f"     says: {rec.text.strip()!r}" + ("  (unverified)" if rec.unverified_tokens else ""),
        f"     action: {rec.action} ({rec.parse}{'; ' + rec.parse_note if rec.parse_note else ''}) -> "
        f"sent {command_text(rec.command_peak)}; think {rec.latency_ms.get('generate', 0) / 1e3:.1f}s ({dec})",
    ]
    lines[-1] += overlap_text(rec)
    if rec.reason:
        lines.append(f"     why: {rec.reason}")
    return "\n".join(lines)


def overlap_text(rec: Step) -> str:
    """What overlapped (agent.overlap): "; thought during step 3's motion (1.2s), stood 0.4s", or how long the
    robot stood for a step decided standing."""
    lat = rec.latency_ms
    stood = f"stood {lat['standing'] / 1e3:.1f}s" if "standing" in lat else ""
    if rec.decided_during:
        moving = f"thought during step {rec.decided_during}'s motion ({lat.get('think_moving', 0) / 1e3:.1f}s)"
        return "; " + ", ".join(p for p in (moving, stood) if p)
    return f"; {stood}" if stood else ""


def printer(write: Callable[[str], None] = print) -> Callable[[int, Step], None]:
    """An on_step hook that writes each step's lines (`write`: print, or a file's)."""
    return lambda n, rec: write(step_lines(n, rec))
