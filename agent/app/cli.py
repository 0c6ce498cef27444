"""The `edge-agent` command: `generate` (one prompt through AR, SD or the draft alone, with metrics), `run`
(the robot daemon) and `serve` (the OpenAI-compatible endpoint); their flags are derived from
agent/app/config.py's declarations."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from protocol.sampling import SamplingError, SamplingParams
from runtime import settings

from . import config
from .config import GenerateOptions, ServeOptions

if TYPE_CHECKING:
    from agent.decoding import DecoderSettings

    from .api import LocalApi
    from .daemon import Daemon

log = logging.getLogger("edge-agent")


def _generate(args: argparse.Namespace) -> int:
    from agent.decoding import open_decoder
    from agent.decoding.link import LinkLost, ServerError

    opts = GenerateOptions(**{f.name: getattr(args, f.name) for f in fields(GenerateOptions)})
    if not (opts.local or opts.mode == "local") and not opts.verifier:
        print("edge-agent: give --verifier ws://HOST:PORT, or --local for the draft alone", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=opts.temperature, top_k=opts.top_k, seed=opts.seed, top_p=opts.top_p)
        images = [Path(f).read_bytes() for f in opts.image]  # a missing file is said before the model loads
        decoder = open_decoder(_decoder_settings(opts))
        drafter = decoder.drafter
        prompt_ids, prompt_images = _prompt(drafter, opts.prompt, images, opts.chat)
    except (OSError, ValueError, SamplingError) as e:  # a missing file, an image that is no JPEG/PNG, a policy
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    stream = _Stream(lambda ids: drafter.detokenize(ids, skip=decoder.stop_ids()))
    try:
        with stream.catching_sigint():
            gen = decoder.generate(
                prompt_ids, max_tokens=opts.max_tokens, params=params, images=prompt_images, until=stream
            )
    except (LinkLost, ServerError) as e:
        stream.end()
        print(f"edge-agent: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, ValueError) as e:  # no predictor for this pair, a policy the mode lacks
        stream.end()
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first token
        stream.end()
        print(f"edge-agent: interrupted; {stream.shown} tokens committed (above)", file=sys.stderr)
        return 130
    finally:
        decoder.close()
    stream.end(gen.token_ids)
    if stream.interrupted:
        print(f"edge-agent: interrupted; {len(gen.token_ids)} tokens committed (above)", file=sys.stderr)
        return 130
    _report(gen)
    if opts.json:
        print(json.dumps(gen.to_json()))
    return 0


class _Stream:
    """generate's text on stdout as the target commits it: the decoder's `until` hook, which sees every
    committed output prefix and never ends the generation, unless Ctrl-C came (then it ends it there)."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self.detokenize = detokenize
        self.text = ""  # what is on stdout
        self.shown = 0  # tokens it is made of
        self.interrupted = False

    def __call__(self, ids: list[int]) -> bool:
        if len(ids) > self.shown:
            self._show(ids)
        return self.interrupted

    def _show(self, ids: list[int]) -> None:
        text = self.detokenize(ids)
        if text.startswith(self.text):  # (a token that completes a character changes no earlier text)
            sys.stdout.write(text[len(self.text) :])
            sys.stdout.flush()
            self.text, self.shown = text, len(ids)

    def end(self, ids: list[int] | None = None) -> None:
        """The rest of the output (the last tokens, which no hook saw past a stop), then a newline."""
        if ids is not None and len(ids) > self.shown:
            self._show(ids)
        print(flush=True)

    @contextlib.contextmanager
    def catching_sigint(self) -> Iterator[None]:
        """The first Ctrl-C ends the generation at the next commit; a second one interrupts at once."""
        import signal

        def first(signum: int, frame: Any) -> None:
            self.interrupted = True
            signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = signal.signal(signal.SIGINT, first)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def _prompt(drafter: Any, prompt: str, images: list[bytes], chat: bool) -> tuple[list[int], list]:
    """The prompt's token ids and its images on their markers."""
    if images:
        return drafter.image_prompt(prompt, images, chat=chat)
    return drafter.tokenize(prompt, chat=chat), []


def _decoder_settings(opts: GenerateOptions | ServeOptions) -> DecoderSettings:
    """The command's DecoderSettings: its own (inherited) fields, the token from $VERIFIER_TOKEN when no flag
    gave one, this machine's robot id when none was given, and --local's draft alone."""
    from agent.decoding import DecoderSettings
    from agent.decoding.link import default_robot_id

    local = isinstance(opts, GenerateOptions) and opts.local or opts.mode == "local"
    return DecoderSettings.of(
        opts,
        verifier=None if local else opts.verifier,
        mode="local" if local else opts.mode,
        token=opts.token or os.environ.get("VERIFIER_TOKEN", ""),
        robot_id=opts.robot_id or default_robot_id(),
    )


def _report(gen: Any) -> None:
    """The metrics of one generation, on stderr (the text is on stdout already); what a run lacks (tau and
    acceptance without drafts, gamma* without its policy) is left out, never printed as None."""
    m = gen.metrics
    drafts = "" if m.tau is None else f", tau {m.tau:.2f}"
    drafts += "" if m.acceptance_rate is None else f", acceptance {m.acceptance_rate:.3f}"
    print(
        f"[{gen.mode}] {len(gen.token_ids)} tokens in {m.wall_s:.2f}s ({m.tokens_per_s:.1f} tok/s); "
        f"rounds {m.rounds}{drafts}, "
        f"draft {m.draft_ms:.0f} ms, verify {m.verify_ms:.0f} ms, network {m.network_ms:.0f} ms, "
        f"up {m.bytes_up} B, down {m.bytes_down} B",
        file=sys.stderr,
    )
    if gen.mode == "fsd":
        print(
            f"[fsd] pre-draft hits {m.predraft_hits}, misses {m.predraft_misses}, failures "
            f"{m.predraft_failures}, exits received {m.exits_received}"
            + ("" if m.avg_exit_layer is None else f", avg exit layer {m.avg_exit_layer:.1f}"),
            file=sys.stderr,
        )
    if gen.mode in ("sd", "fsd"):
        print(
            f"[{m.draft_policy}] draft lengths {dict(sorted(m.draft_lengths.items(), key=lambda kv: int(kv[0])))}"
            f", predictor stops {m.predictor_stops}"
            + ("" if m.gamma_star is None else f", gamma* {m.gamma_star}")
            + ("" if m.expected_speedup is None else f", expected speedup {m.expected_speedup:.2f}")
            + f", streamed alone {m.streamed_tokens}, AS2 switches {[s['to'] for s in m.as2_switches]}",
            file=sys.stderr,
        )


INSTRUCTION_STEPS = 30  # --instruction's steps when --max-steps is not given


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from agent.robot.camera import CameraError
    from agent.robot.controllers.base import ControllerError
    from agent.robot.scene import SceneError

    from .api import LocalApi
    from .daemon import Daemon

    shortcuts = [
        f"{section}.{name}={json.dumps(getattr(args, f'{section}_{name}'))}"  # a JSON string is a TOML string
        for section, name, _ in config.shortcut_flags()
        if getattr(args, f"{section}_{name}") is not None
    ]
    shortcuts += [
        f"robot.options.{key}={json.dumps(value)}"
        for key, value in (("scene", args.scene), ("start", args.start))
        if value is not None
    ]
    if args.json and not (args.instruction and args.exit_when_done):
        print("edge-agent: --json reports the episode of --instruction: give it with --exit-when-done", file=sys.stderr)
        return 2
    try:
        cfg = config.load(args.config, shortcuts + list(args.set))
        if (args.scene is not None or args.start is not None) and cfg.robot.controller != "sim":
            raise config.ConfigError(
                f"--scene and --start are the simulator's: robot.controller is {cfg.robot.controller!r}, not 'sim'"
            )
        cfg.api.secrets()  # the local API's token files are read before anything moves
        daemon = Daemon(cfg, on_step=_step_printer(args), **({"max_steps": args.max_steps} if args.max_steps else {}))
        if args.instruction:  # one the scene cannot answer is refused before the models load
            daemon.check_instruction(args.instruction)
    except (config.ConfigError, ControllerError, SceneError, ValueError) as e:
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    if args.instruction and args.exit_when_done and not cfg.link.verifier and cfg.offline.policy == "hold":
        log.warning(
            "no verifier and offline.policy 'hold': the robot will hold still until the task times out "
            "(--offline local lets the draft model alone drive)"
        )
    if not args.quiet:
        print(
            "edge-agent: loading the draft model and prefilling the prompt on both sides (10-30 s on a small CPU) ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        daemon.start(notify_ready=False)
    except (ControllerError, CameraError, FileNotFoundError, ValueError) as e:
        print(f"edge-agent: cannot start: {e}", file=sys.stderr)
        daemon.close()
        return 2
    never = _never_answered(daemon, args)
    if never:
        print(f"edge-agent: {never}", file=sys.stderr)
        daemon.close()
        return 3
    try:
        rc = asyncio.run(_serve(daemon, LocalApi(daemon), args))
    finally:
        daemon.close()
    if args.json:
        print(json.dumps(_episode_summary(daemon, args.instruction)), flush=True)
    return rc


def _step_printer(args: argparse.Namespace) -> Any:
    """`run`'s transcript on stdout, the demo's lines per step (agent/app/transcript.py); None with --quiet."""
    if args.quiet:
        return None
    from .transcript import step_lines

    return lambda n, rec: print(step_lines(n, rec), flush=True)


def _never_answered(daemon: Daemon, args: argparse.Namespace) -> str:
    """Why --exit-when-done gives up at once ("" when it does not): the verifier did not answer at start and
    offline.policy "hold" would only hold the robot until agent.task_timeout_s."""
    cfg = daemon.cfg
    if not (args.exit_when_done and args.instruction and cfg.link.verifier and cfg.offline.policy == "hold"):
        return ""
    if daemon.nav is None or daemon.nav.link == "up":
        return ""
    return (
        f"the verifier at {cfg.link.verifier} did not answer; with offline.policy 'hold' the robot would only "
        "hold still (start server-bridge there, or --offline local to let the draft model alone drive)"
    )


def _episode_summary(daemon: Daemon, instruction: str) -> dict:
    """The --json line: how the --instruction's task went (agent/app/episode.py's names; in the simulator also
    whether the robot reached what the instruction names, the path it took and the shortest one)."""
    from .episode import summarize

    end = daemon.history[-1]["state"] if daemon.history else "interrupted"
    records = daemon.task_records
    if daemon.world is None:
        return {
            "instruction": instruction,
            "end": end,
            "steps": len(records),
            "verified_steps": sum(r.mode == "verified" for r in records),
            "offline_steps": sum(r.mode == "offline" for r in records),
        }
    return summarize(daemon.world, records, instruction, end=end, reach_m=daemon.cfg.agent.reach_m)


async def _started(api: Any, what: str) -> Any:
    """Start a listener (the local API, the OpenAI endpoint) with SIGINT and SIGTERM setting the returned
    asyncio.Event; None, after one line on stderr, when it cannot start."""
    import asyncio
    import signal

    from .config import ConfigError

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await api.start()
    except (ConfigError, OSError) as e:  # the socket's folder, its group, an address in use
        print(f"edge-agent: cannot start {what}: {e}", file=sys.stderr)
        return None
    return done


async def _serve(daemon: Daemon, api: LocalApi, args: argparse.Namespace) -> int:
    import asyncio

    done = await _started(api, "the local API")
    if done is None:
        return 2
    daemon.notifier.ready()
    telemetry = daemon.telemetry.path or "off"
    print(f"edge-agent: ready; local API at {api.address}; telemetry {telemetry}", file=sys.stderr, flush=True)
    if args.instruction:
        daemon.submit(args.instruction, max_steps=args.max_steps or INSTRUCTION_STEPS)
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
        if args.exit_when_done and args.instruction and daemon.history:
            break
    await api.close()
    return 0


def _setup_logging(level: str) -> None:
    """stderr for journald; under systemd (JOURNAL_STREAM set) each line carries its syslog priority
    as a <N> prefix, so `journalctl -p warning` filters it and no timestamp is doubled."""
    if os.environ.get("JOURNAL_STREAM"):
        priority = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

        class Priority(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                record.priority = priority.get(record.levelno, 6)
                return True

        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(Priority())
        handler.setFormatter(logging.Formatter("<%(priority)d>%(name)s: %(message)s"))
        logging.basicConfig(level=level.upper(), handlers=[handler])
    else:
        logging.basicConfig(
            level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )


def _add_run(sub: Any) -> None:
    r = sub.add_parser(
        "run", help="the robot daemon: camera + instruction -> safe navigation actions (systemd/edge-agent.service)"
    )
    r.add_argument("--config", help="TOML config (systemd/edge-agent.toml is the annotated example)")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set safety.max_vx=0.3 (repeatable; the value is TOML)",
    )
    for section, name, field in config.shortcut_flags():  # --verifier = --set link.verifier=..., ...
        default = settings.default_of(field)
        r.add_argument(
            field.metadata["flag"],
            dest=f"{section}_{name}",
            type=type(default) if type(default) in (int, float) else None,  # (a number goes to TOML as one)
            choices=field.metadata.get("choices"),
            help=f"= --set {section}.{name}=...: {settings.help_of(field)}".replace("%", "%%"),
        )
    from agent.robot.scene import builtin_scenes

    r.add_argument(
        "--scene",
        help="sim: a scene file (JSON, agent/robot/scene.py) or a shipped scene's name: "
        f"{', '.join(builtin_scenes())} (= --set robot.options.scene=...)",
    )
    r.add_argument(
        "--start", type=int, help="sim: which of the scene's start poses, from 0 (= --set robot.options.start=...)"
    )
    r.add_argument("--instruction", help="submit this instruction at start (as the local API's submit would)")
    r.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=f"steps per instruction before the robot gives up (default {INSTRUCTION_STEPS} for "
        "--instruction, 40 for the local API's tasks)",
    )
    r.add_argument("--exit-when-done", action="store_true", help="with --instruction: exit once it has finished")
    r.add_argument(
        "--quiet", action="store_true", help="no line per step on stdout (by default: what each step saw, said and did)"
    )
    r.add_argument(
        "--json",
        action="store_true",
        help="with --instruction and --exit-when-done: the last stdout line is one JSON object saying how "
        "it went (reached, steps, distance_m, collisions, verified_steps, offline_steps, path_m, "
        "shortest_m, spl, ...)",
    )


# ------------------------------------------------------------------ edge-agent serve (the OpenAI endpoint)


def _serve_openai(args: argparse.Namespace) -> int:
    """`edge-agent serve`: the OpenAI-compatible endpoint (agent/app/openai_api.py) over one Client, until
    SIGINT or SIGTERM."""
    import asyncio

    from agent.client import Client

    from .config import ConfigError, ServeOptions
    from .openai_api import OpenAiApi

    try:
        opts = ServeOptions(**{f.name: getattr(args, f.name) for f in fields(ServeOptions)})
        key = opts.key()
        decoder = _decoder_settings(opts)
        client = Client(decoder, offline=opts.offline)
        api = OpenAiApi(
            client,
            opts.listen,
            api_key=key,
            offline=opts.offline,
            max_pending=opts.max_pending,
            model=opts.model_name,
            allowed_hosts=opts.allowed_hosts,
            allowed_origins=opts.allowed_origins,
        )
    except (ConfigError, OSError, ValueError) as e:
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2
    with client:
        return asyncio.run(_serve_endpoint(api, opts.verifier))


async def _serve_endpoint(api: Any, verifier: str | None) -> int:
    done = await _started(api, "the OpenAI endpoint")
    if done is None:
        return 2
    where = verifier or "none: every answer is the draft's alone"
    print(f"edge-agent: OpenAI endpoint at {api.address}/v1 (verifier: {where})", file=sys.stderr, flush=True)
    await done.wait()
    await api.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    """edge-agent's flags (docs/reference/cli.md is generated from this parser: tests/test_docs_cli.py)."""
    ap = argparse.ArgumentParser(prog="edge-agent", description="The robot side of speculative edge-cloud decoding.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {settings.version()}")
    log_help = "default: INFO for run (the config in use is logged), WARNING otherwise"
    ap.add_argument("--log-level", default=None, help=log_help)
    sub = ap.add_subparsers(dest="cmd", required=True)
    settings.add_flags(sub.add_parser("generate", help="answer one prompt"), GenerateOptions)
    _add_run(sub)
    settings.add_flags(
        sub.add_parser("serve", help="an OpenAI-compatible endpoint (/v1/chat/completions)"), ServeOptions
    )
    for command in sub.choices.values():  # --log-level before or after the subcommand, as a user puts it
        command.add_argument("--log-level", default=argparse.SUPPRESS, help=log_help)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args.log_level or ("INFO" if args.cmd == "run" else "WARNING"))
    try:  # every error a user can cause is one line on stderr and a non-zero exit, not a traceback
        if args.cmd == "generate":
            return _generate(args)
        if args.cmd == "run":
            return _run(args)
        if args.cmd == "serve":
            return _serve_openai(args)
    except OSError as e:  # a model file unreadable, a device gone, ...
        print(f"edge-agent: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads, before run's own handlers are up
        print("edge-agent: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
