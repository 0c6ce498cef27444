"""Robots per GPU: the largest fleet that holds 8, 4 and 2 tok/s per robot, SD on each engine against llama-server.

    python -m tools.bench.gpu_fleet [--out bench_results/gpu_fleet]               # a CUDA server, Llama-7B shape
    python -m tools.bench.gpu_fleet --tiny --device cpu --no-peer --out /tmp/f    # the same code on a toy model

On a CUDA server the llamacpp engine and the peer need CUDA builds of llama.cpp: `make setup
LLAMA_FLAVOUR=cuda LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"` for the wheel, `--build-peer` (or `make llama-server`
with the same two variables) for llama-server. The figure a fleet operator asks for: how many robots one
GPU serves at a given speed per robot.

What is real, what is replayed, what is modelled:

  target      real passes of a Llama of 7B shape (hidden 4096, 32 layers, 32 heads, FFN 11008, the
              SmolLM2 vocabulary of 49152 so the robots' drafts share it) with random weights, made here
              by tools/models/random_target.py: an F16 (or --dtype f32) GGUF for the llamacpp engine and
              llama-server, and a Hugging Face directory with the same tensors for the torch engine.
              A greedy path is planted in the random weights (the token after any prefix is a fixed
              successor of the last token, by a margin no batch's rounding can flip), so a robot knows
              what the target will say. Cached by shape under models/build (--model-dir).
  server      real: `server-bridge serve` in its own process per engine (a CUDA llama.cpp and a CUDA
              torch must never share one), the SLO scheduler (`scheduler = "slo"`), batching, sessions,
              the wire; its verification-time estimator is fitted first, on this machine and engine,
              over the batch shapes this fleet makes (`server-bridge profile --shapes fleet`; --estimator).
  robots      N websocket clients in this process (tools/bench/loadgen.py's Robot, run_robots and summarize),
              through the real wire on loopback (no network delay). A robot does not run a draft model:
              it REPLAYS a recorded trace (tools/traces/<pair>__smollm2-f32.json, the shipped Q4_1 draft
              against the SmolLM2 target by default). At each committed position i the trace says how
              many of the real draft's tokens the real target accepted, a_i; the robot sends the planted
              path's next a_i tokens and then a token the target rejects (gamma tokens in all), sleeps
              --draft-ms-per-token per drafted token first (25 ms: an Orin-class draft of a 7B's
              partner), and commits what the server's `result` says. So the server really verifies every
              chain and accepts exactly what the real pair accepted: tokens per round follow the trace
              (`planned_tau` in the JSON) while every pass, batch and queue is real. `exact` checks the
              committed text is the planted path, i.e. that every verdict was the target's.
  peer        llama.cpp's own `llama-server` (tools/bench/peer.py, built from the same llama.cpp sources) with
              `--parallel N` continuous batching, streaming plain AR of the same prompts to N robots.
              It is blind to the rate a robot needs, so one sweep judges every class: a generation
              holds c tok/s when tokens / (last token - request) >= c (tools/bench/loadgen.py's rule).

A fleet holds a rate when <= 5 % of the generations opened in the window miss it (or are shed),
at that N and every smaller N tried (server_bridge/ops/loadtest.py:capacity). SD fleets are homogeneous, one sweep
per class (the SLO scheduler is told each robot's rate); N doubles from --start-n (the tighter
class's capacity for the looser ones) until a point fails or --max-n, then bisects to within
--refine. llama.cpp holds at most 256 sequences per context (LLAMA_MAX_SEQ): its fleets stop at
248 robots, and a capacity there is a lower bound. On a GPU --max-n is also bounded by the KV memory
left beside the weights. Each robot generates --tokens tokens a generation, back to back.

Writes gpu_fleet.json (command, machine, model, engine settings, every point, capacities),
gpu_fleet.md and gpu_fleet.png into --out, and the servers' configs beside them; the JSON and the
table are rewritten after each system, so a long run leaves what it has.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime import settings
from runtime.settings import setting
from server_bridge.ops import loadtest
from server_bridge.ops.fleet import health
from server_bridge.ops.loadtest import LoadConfig, Trace, TracePrompt
from tools.bench import harness, loadgen
from tools.models import random_target

TRACES = Path(__file__).resolve().parents[1] / "traces"
CLASSES = (8, 4, 2)  # tokens/s per robot, tightest first
LLAMA_MAX_SEQ = 256  # llama.cpp's sequences per context (the llamacpp engine and llama-server)
LLAMA_MAX_ROBOTS = LLAMA_MAX_SEQ - 8  # room for sessions that are closing while the next point opens
SYSTEMS = {"llamacpp": "SD, llamacpp engine", "torch": "SD, torch engine", "llama-server": "llama-server AR"}


def _numbers(kind: type) -> Callable[[str], tuple]:
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def _speeds(s: str) -> tuple:
    return tuple(int(c) if float(c).is_integer() else float(c) for c in s.split(",") if c)


@dataclass(frozen=True)
class FleetConfig:
    """The benchmark's settings; each field is a flag (`--max-batch`), declared here only."""

    tiny: bool = setting(False, help="A 2-layer, hidden-64 target, vocabulary 49152 (checks the code, not the GPU).")
    device: str = setting("cuda", choices=("cuda", "cpu"), help="Where the server runs.")
    dtype: str = setting(
        "f16", choices=random_target.DTYPES, help="The random target's GGUF (q8_0, q4_0: blocks written directly)."
    )
    torch_dtype: str = setting(
        "auto", help="The torch engine's compute dtype (auto: float16 for f16 on CUDA, bfloat16 for q8_0 or q4_0)."
    )
    engines: tuple = setting(("llamacpp", "torch"), parse=_numbers(str), help="The engines to run, one at a time.")
    peer: bool = setting(True, help="Also llama-server (AR) on the same target.")
    classes: tuple = setting(CLASSES, parse=_speeds, help="The robots' SLO classes, tokens/s.")
    pair: str = setting("smollm2-q4_1", help="The recorded trace: tools/traces/<pair>__smollm2-f32.json.")
    gamma: int = setting(4, help="Draft tokens a round.")
    draft_ms: float = setting(25.0, flag="--draft-ms-per-token", help="Modelled drafting cost per token (ms).")
    tokens: int = setting(48, help="Tokens a generation.")
    warmup_s: float = setting(5.0, help="Before each point's window (s).")
    window_s: float = setting(15.0, help="Each point's window (s).")
    ns: tuple = setting((), flag="--n", parse=_numbers(int), help="Fixed fleet sizes instead of the search.")
    start_n: int = setting(1, help="The search's first fleet size.")
    max_n: int = setting(512, help="The search's largest fleet size.")
    refine: float = setting(0.1, help="Bisect until the gap is <= refine x N.")
    max_batch: int = setting(32, help="The server's max_batch.")
    estimator: str = setting(
        "profile", help="profile (fit here first: `server-bridge profile --shapes fleet`), '' (defaults) or a file."
    )
    server_threads: int = setting(0, help="0: 1 on the CPU (pinned), 4 on CUDA.")
    seed: int = setting(0, help="The random target's and the robots' seed.")

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or self.dtype not in random_target.DTYPES:
            raise ValueError(
                f"device must be cuda or cpu and dtype one of {random_target.DTYPES}, got {self.device}, {self.dtype}"
            )
        if not set(self.engines) <= {"llamacpp", "torch"}:
            raise ValueError(f"engines are llamacpp and torch, got {self.engines}")
        if not self.classes or any(c <= 0 for c in self.classes):
            raise ValueError(f"classes must be positive tokens/s, got {self.classes}")
        if self.start_n < 1 or self.max_n < self.start_n or not 0 < self.refine < 1 or any(n < 1 for n in self.ns):
            raise ValueError("need 1 <= start_n <= max_n, 0 < refine < 1 and fleet sizes >= 1")
        LoadConfig(
            gamma=self.gamma, draft_ms=self.draft_ms, tokens=self.tokens, warmup_s=self.warmup_s, window_s=self.window_s
        )  # its own checks

    @property
    def threads(self) -> int:
        return self.server_threads or (4 if self.device == "cuda" else 1)

    def load_config(self, classes: tuple) -> LoadConfig:
        return LoadConfig(
            gamma=self.gamma,
            draft_ms=self.draft_ms,
            tokens=self.tokens,
            classes=classes,
            warmup_s=self.warmup_s,
            window_s=self.window_s,
            seed=self.seed,
        )


# --------------------------------------------------------------------------- the replayed robots


def agreement(chain: list[int], continuation: list[int]) -> int:
    """How many leading draft tokens the target accepts at T = 0: the common prefix."""
    n = 0
    for a, b in zip(chain, continuation, strict=False):
        if a != b:
            break
        n += 1
    return n


def replay_trace(recorded: Trace, successor, target_name: str) -> Trace:
    """The recorded trace moved onto the random target's planted path, acceptance for acceptance.

    At committed position i the recorded draft agreed with the recorded target for a_i tokens;
    the replayed chain is the planted path's next a_i tokens, then a token the target rejects
    (then anything), gamma_max in all. loadgen's robots send chains[i][:gamma] on the path.
    """
    prompts = []
    for p in recorded.prompts:
        path = random_target.greedy_path(successor, p.prompt_ids[-1], len(p.target_ids) + recorded.gamma_max + 1)
        chains = []
        for i, chain in enumerate(p.chains):
            a = agreement(chain, p.target_ids[i:])
            planted = path[i : i + a]
            if a < recorded.gamma_max:
                planted.append(path[i + a + 1])  # != path[i + a] (the cycle has no fixed point): rejected
            while len(planted) < recorded.gamma_max:
                planted.append(int(successor[planted[-1]]))
            chains.append(planted)
        prompts.append(TracePrompt(p.prompt_ids, path[: len(p.target_ids)], chains))
    return Trace(
        recorded.draft,
        target_name,
        recorded.vocab_hash,
        recorded.vocab_size,
        recorded.eos_ids,
        recorded.gamma_max,
        prompts,
    )


def planned_tau(trace: Trace, gamma: int, tokens: int) -> float:
    """Tokens per round a robot commits replaying `trace` (what loadgen's robot sends, walked offline)."""
    committed = rounds = 0
    for p in trace.prompts:
        goal, i = min(tokens, len(p.target_ids)), 0
        while i < goal:
            k = min(gamma, goal - i - 1)
            i += min(agreement(p.chains[i][:k], p.target_ids[i:]), k) + 1
            rounds += 1
        committed += i
    return committed / rounds


# --------------------------------------------------------------------------- the search


def sizes_within(ns: tuple, max_n: int) -> tuple:
    """The fixed fleet sizes a system can take (max_n if it can take none of them); () = search."""
    if not ns:
        return ()
    return tuple(n for n in ns if n <= max_n) or (max_n,)


# --------------------------------------------------------------------------- one point


def judged(records: list[dict], classes: tuple) -> dict:
    """Per class c, over a point's sampled generations: the share that missed c tok/s or were lost.

    A record of the window's sample is already decided at its own (loosest) class; a generation
    that met it is judged again at each tighter c by its speed.
    """
    sample = [r for r in records if r["in_sample"]]
    out = {}
    for c in classes:
        bad = [r["violated"] or r["tokens_per_s"] is None or r["tokens_per_s"] < c for r in sample]
        rate = sum(bad) / len(bad) if bad else None
        out[str(c)] = {
            "violation_rate": rate,
            "decided": len(bad),
            "passes": loadtest.point_passes(rate, {}) if bad else None,
        }
    return out


def point_record(system: str, n: int, cls: list[str], s: dict, by_class: dict, extra: dict) -> dict:
    """A point as the JSON keeps it: the figures, without the per-generation records."""
    keep = (
        "goodput_tokens_per_s",
        "slo_met_tokens_per_s",
        "rounds",
        "tokens_per_round",
        "round_ms_mean",
        "round_ms_p95",
        "sheds",
        "generations",
        "stale",
        "tail_s",
        "speed_by_class",
    )
    speeds = [r["tokens_per_s"] for r in s.get("generation_records", []) if r["in_sample"] and r["tokens_per_s"]]
    return {
        "system": system,
        "n": n,
        "classes": cls,
        "judged": by_class,
        **{k: s.get(k) for k in keep},
        "speed_mean": sum(speeds) / len(speeds) if speeds else None,
        "speed_min": min(speeds) if speeds else None,
        "errors": len(s.get("errors", [])),
        "error_samples": s.get("errors", [])[:3],
        **extra,
    }


def describe(p: dict) -> str:
    pct = lambda r: "-" if r is None else f"{100 * r:.0f}%"  # noqa: E731
    verdicts = " ".join(
        f"{c} tok/s: {pct(j['violation_rate'])} {'ok' if j['passes'] else 'FAIL'}" for c, j in p["judged"].items()
    )
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    flags = ("" if p.get("exact", True) else "  NOT EXACT") + (f"  errors {p['errors']}" if p["errors"] else "")
    if p.get("client_cpu", 0) > 0.85:
        flags += f"  robots' process at {100 * p['client_cpu']:.0f}% CPU: the client may limit"
    return (
        f"{SYSTEMS[p['system']]:<20} N={p['n']:<4} {verdicts}  speed mean/min {num(p['speed_mean'], '.1f')}/"
        f"{num(p['speed_min'], '.1f')} tok/s  goodput {p['goodput_tokens_per_s']:.1f} tok/s  tokens/round "
        f"{num(p['tokens_per_round'], '.2f')}  round ms {num(p['round_ms_mean'], '.0f')}/"
        f"{num(p['round_ms_p95'], '.0f')}  shed {p['sheds']}{flags}"
    )


def wait_idle(port: int, timeout_s: float = 30.0) -> None:
    """Until the server holds no session and no queued request (the previous point's are closing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = health(port, timeout=5.0)[1]
        if h.get("sessions", 0) == 0 and h.get("queue", 0) == 0:
            return
        time.sleep(0.2)


def sd_point(engine: str, url: str, port: int, trace: Trace, n: int, lcfg: LoadConfig) -> dict:
    """N replayed robots against a running server-bridge: one point."""
    wait_idle(port)
    c0, t0 = time.process_time(), time.monotonic()
    out = asyncio.run(loadtest.run_robots(url, trace, n, lcfg, metrics_port=port))
    cpu = (time.process_time() - c0) / max(1e-9, time.monotonic() - t0)
    s = loadtest.summarize(out, trace, lcfg.classes)
    cls = [str(c) for c in lcfg.classes]
    by_class = {
        c: {
            "violation_rate": s["violation_rate_by_class"][c],
            "decided": s["decided_by_class"][c],
            "passes": s["passes"],
        }
        for c in cls
    }
    means = loadtest.server_figures(out.metrics)["means"]
    return point_record(
        engine,
        n,
        cls,
        s,
        by_class,
        {
            "exact": s["exact"],
            "client_cpu": round(cpu, 3),
            "server_means": {k.removeprefix("bridge_"): round(v, 3) for k, v in means.items()},
        },
    )


# --------------------------------------------------------------------------- machine, subprocesses


def machine_info() -> dict:
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "gpu": None,
    }
    for pkg in ("torch", "transformers", "llama-cpp-python", "gguf"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = None
    if shutil.which("nvidia-smi"):  # not torch.cuda: this process holds no CUDA context
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if q.returncode == 0 and q.stdout.strip():
            name, total, free, driver = [x.strip() for x in q.stdout.splitlines()[0].split(",")]
            info["gpu"] = {
                "name": name,
                "memory_total_mib": int(total),
                "memory_free_mib": int(free),
                "driver": driver,
                "count": len(q.stdout.splitlines()),
            }
    return info


def kv_bound(machine: dict, shape: random_target.Shape, dtype: str, context: int) -> int | None:
    """Sessions whose KV (f16, `context` tokens each) fits in the GPU's free memory beside the weights."""
    gpu = machine.get("gpu")
    if not gpu:
        return None
    room = gpu["memory_free_mib"] * 2**20 * 0.9 - shape.weight_bytes(dtype) - 4 * 2**30  # 4 GiB: activations, head
    return max(0, int(room // (context * shape.kv_bytes_per_token(2))))


def run_json(cmd: list[str], say, cpus: set[int] | None = None, timeout_s: float = 3600) -> dict:
    """Run a tool in its own process (on `cpus`, if given); its last stdout line is JSON."""
    say("  $ " + shlex.join(cmd))
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    if r.returncode not in (0, 1) or not r.stdout.strip():
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def engine_target(target: random_target.RandomTarget, engine: str) -> Path:
    return target.gguf if engine == "llamacpp" else target.hf_dir


def torch_dtype(cfg: FleetConfig) -> str:
    if cfg.torch_dtype != "auto":
        return cfg.torch_dtype
    if cfg.device != "cuda":
        return "float32"
    return "float16" if cfg.dtype == "f16" else "bfloat16" if cfg.dtype in random_target.QUANTIZED else "float32"


def check_engine(cfg: FleetConfig, target: random_target.RandomTarget, engine: str, say) -> dict:
    """tools.models.random_target check in a subprocess: loads, vocabulary hash, greedy follows the planted path."""
    cmd = [
        sys.executable,
        "-m",
        "tools.models.random_target",
        "check",
        str(engine_target(target, engine)),
        "--engine",
        engine,
        "--device",
        cfg.device,
        "--dtype",
        torch_dtype(cfg),
        "--seed",
        str(cfg.seed),
    ]
    return run_json(cmd, say)


def fit_estimator(
    cfg: FleetConfig, target: random_target.RandomTarget, engine: str, trace: Trace, out: Path, cpus: dict, say
) -> tuple[str, dict | None]:
    """The verification-time estimator the server loads: fitted here over the fleet's own batch shapes
    (`server-bridge profile --shapes fleet`, in the server's place), none (""), or a given file."""
    if cfg.estimator != "profile":
        return cfg.estimator, None
    prompts = sorted({len(p.prompt_ids) for p in trace.prompts})
    cached = sorted({prompts[0], prompts[-1], prompts[-1] + cfg.tokens})
    model_out = out / f"estimator-{engine}.json"
    cmd = [
        sys.executable,
        "-m",
        "server_bridge.cli",
        "profile",
        "--shapes",
        "fleet",
        "--bootstrap",
        "0",
        "--target",
        str(engine_target(target, engine)),
        "--engine",
        engine,
        "--device",
        cfg.device,
        "--dtype",
        torch_dtype(cfg),
        "--threads",
        str(cfg.threads),
        "--max-batch",
        str(cfg.max_batch),
        "--gamma",
        str(cfg.gamma),
        "--cached",
        ",".join(map(str, cached)),
        "--prompts",
        ",".join(map(str, prompts)),
        "--batches",
        "60" if cfg.tiny else "160",
        "--seed",
        str(cfg.seed),
        "--out",
        str(model_out),
    ]
    fitted = run_json(cmd, say, cpus.get("server"))
    say(
        f"  estimator: {json.dumps(fitted['coefficients'])}, test R2 {fitted['test']['r2']:.3f}, MAPE "
        f"{fitted['test']['mape_pct']:.1f} % ({fitted['seconds']}s)"
    )
    return str(model_out), fitted


def server_toml(
    cfg: FleetConfig, target: random_target.RandomTarget, engine: str, sessions: int, context: int, estimator: str
) -> str:
    """The server's config for this benchmark (saved beside the results; flags would override it)."""
    values = {
        "target": str(engine_target(target, engine)),
        "engine": engine,
        "scheduler": "slo",
        "exits": "",
        "estimator": estimator,
        "max_sessions": sessions,
        "max_sessions_per_connection": 2,
        "max_connections": sessions + 16,
        "max_context": context,
        "kv_tokens": sessions * context,
        "max_batch": cfg.max_batch,
        "max_queue": max(128, sessions),
        "detached_grace_s": 1.0,
        "threads": cfg.threads,
    }
    if engine == "torch":
        values.update(device=cfg.device, dtype=torch_dtype(cfg))
    else:
        values.update(n_gpu_layers=-1 if cfg.device == "cuda" else 0)
    lines = ["[server]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def context_tokens(trace: Trace, cfg: FleetConfig) -> int:
    """A session's KV: the longest prompt, a generation and a draft, with room; a multiple of 64."""
    need = max(len(p.prompt_ids) for p in trace.prompts) + cfg.tokens + cfg.gamma + 16
    return -(-need // 64) * 64


# --------------------------------------------------------------------------- the systems


def run_sd(cfg: FleetConfig, engine: str, target, trace: Trace, max_n: int, out: Path, cpus: dict, say) -> dict:
    """One engine: its check, its estimator, one server, a capacity search per class (tightest first)."""
    from server_bridge.ops.fleet import LocalVerifier

    check = check_engine(cfg, target, engine, say)
    say(
        f"  {engine}: loads in {check['load_s']}s on {check['info'].get('device')}, vocab hash "
        f"{check['vocab_hash'][:12]}, greedy follows the planted path: {check['follows_path']}, "
        f"{check['ms_per_token_one_session']} ms a token for one session"
    )
    result = {"check": check, "points": [], "capacity": {}}
    if not check["follows_path"]:
        result["skipped"] = "the engine's greedy tokens leave the planted path (see check)"
        return result
    if cfg.device == "cuda" and engine == "llamacpp" and check["info"].get("device") != "gpu":
        result["skipped"] = (
            'llama-cpp-python was built without CUDA: make setup LLAMA_FLAVOUR=cuda LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"'
        )
        return result
    if engine == "llamacpp":
        max_n = min(max_n, LLAMA_MAX_ROBOTS)
    estimator, result["estimator"] = fit_estimator(cfg, target, engine, trace, out, cpus, say)
    context = context_tokens(trace, cfg)
    toml = out / f"server-{engine}.toml"
    toml.write_text(server_toml(cfg, target, engine, max_n + 8, context, estimator))
    t0 = time.perf_counter()
    with LocalVerifier(
        cpus=cpus.get("server"), threads=cfg.threads, extra_args=["--config", str(toml)], start_timeout_s=1800
    ) as srv:
        result["server_start_s"] = round(time.perf_counter() - t0, 1)
        result["health"] = health(srv.port, timeout=5.0)[1]
        say(f"  server-bridge up in {result['server_start_s']}s: {result['health']}")
        start = cfg.start_n
        try:
            for c in sorted(cfg.classes, reverse=True):
                lcfg = cfg.load_config((c,))

                def run(n: int, lcfg: LoadConfig = lcfg) -> dict:
                    p = sd_point(engine, srv.url, srv.port, trace, n, lcfg)
                    result["points"].append(p)
                    say("  " + describe(p))
                    return {k: j["passes"] for k, j in p["judged"].items()}

                found = loadtest.capacity_search(run, [str(c)], sizes_within(cfg.ns, max_n), start, max_n, cfg.refine)[
                    str(c)
                ]
                result["capacity"][str(c)] = {**found, "max_n": max_n}
                start = max(cfg.start_n, found["capacity"])
        finally:
            log_text = srv.log_path.read_text(errors="replace")
            srv.log_path.unlink(missing_ok=True)
    result["server_config"] = loadgen.server_config(log_text)
    return result


def peer_binary(cfg: FleetConfig, given: str | None, build: bool, say) -> Path | None:
    """llama-server: --peer-binary, else the newest cached build of the right kind (CUDA or not), else built."""
    from tools.bench import peer

    if given:
        return Path(given)
    want_cuda = cfg.device == "cuda"
    builds = sorted(
        peer.CACHE_ROOT.glob(f"llama-server-{peer.VERSION}-*/llama-server"),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for b in builds:
        info = (b.parent / "BUILD_INFO").read_text() if (b.parent / "BUILD_INFO").exists() else ""
        if os.access(b, os.X_OK) and ("GGML_CUDA=on" in info) == want_cuda:
            return b
    if not build:
        return None
    env = dict(os.environ)
    if want_cuda:
        env.update(LLAMA_FLAVOUR="cuda", LLAMA_CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native")
    say(f"  building llama-server ({'CUDA' if want_cuda else 'CPU'}; minutes): bash {peer.BUILD_SCRIPT}")
    r = subprocess.run(["bash", str(peer.BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, env=env, check=True)
    return Path(r.stdout.strip().splitlines()[-1])


def run_peer(cfg: FleetConfig, target, trace: Trace, max_n: int, binary: Path, cpus: dict, say) -> dict:
    """llama-server --parallel N streaming AR: one sweep, every class judged from the same generations."""
    from tools.bench import peer

    max_n = min(max_n, LLAMA_MAX_ROBOTS)
    loose = cfg.load_config((min(cfg.classes),))  # followed to the end: judged for tighter classes after
    extra = ["-ngl", "999"] if cfg.device == "cuda" else []
    core = min(cpus["server"]) if cpus.get("server") else None
    result = {
        "binary": str(binary),
        "version": peer.server_version(binary),
        "extra_args": extra,
        "threads": cfg.threads,
        "core": core,
        "points": [],
        "capacity": {},
    }
    say(f"  {result['version']}")

    def run(n: int) -> dict:
        s = peer.fleet_point(
            target.gguf,
            trace,
            n,
            loose,
            core=core,
            threads=cfg.threads,
            binary=binary,
            cache_ram_mib=0,
            extra_args=extra,
        )
        by_class = judged(s["generation_records"], cfg.classes)
        p = point_record(
            "llama-server",
            n,
            [str(c) for c in cfg.classes],
            s,
            by_class,
            {"exact": s["matches_trace"], "server_start_s": s["server_start_s"]},
        )
        result["points"].append(p)
        say("  " + describe(p))
        return {c: j["passes"] for c, j in by_class.items()}

    found = loadtest.capacity_search(
        run, [str(c) for c in cfg.classes], sizes_within(cfg.ns, max_n), cfg.start_n, max_n, cfg.refine
    )
    result["capacity"] = {c: {**v, "max_n": max_n} for c, v in found.items()}
    return result


# --------------------------------------------------------------------------- reports


def cap_text(c: dict | None) -> str:
    if not c:
        return "-"
    if c["capacity"] == 0:
        return f"< {min(c['tried'])}"
    return f">= {c['capacity']}" if c["lower_bound"] else str(c["capacity"])


def _intro(result: dict) -> str:
    cfg, m, model, tr = result["config"], result["machine"], result["model"], result["trace"]
    shape = model["shape"]
    kv = result.get("kv_bound_sessions")
    return (
        f"`{result.get('command', 'python -m tools.bench.gpu_fleet')}`\n\n"
        f"Target: random weights with a planted greedy path (tools/models/random_target.py), {shape['layers']} "
        f"layers, hidden {shape['hidden']}, {shape['heads']} heads, FFN {shape['intermediate']}, vocab "
        f"{shape['vocab']}, {model['params'] / 1e9:.2f} B parameters ({model['weight_bytes'] / 2**30:.2f} GiB). "
        f"Robots replay {tr['pair']} (planned {tr['planned_tau']:.2f} tokens a round at gamma {cfg['gamma']}), "
        f"{cfg['draft_ms']} ms drafting a token, {cfg['tokens']} tokens a generation, on loopback. Window "
        f"{cfg['window_s']} s after {cfg['warmup_s']} s; a fleet holds a rate when <= 5 % of its generations "
        f"miss it. Machine: {m['cpu_count']} CPU cores, torch {m.get('torch')}, llama-cpp-python "
        f"{m.get('llama-cpp-python')}"
        + (f"; KV room for {kv} sessions of {result['context_tokens']} tokens" if kv is not None else "")
        + f". Started {result['started']}."
    )


def _settings(name: str, s: dict) -> str:
    if s.get("skipped"):
        return f"skipped: {s['skipped']}"
    if name == "llama-server":
        return f"`--parallel N -t {s['threads']} {' '.join(s['extra_args'])}`, {s['version']}"
    sc, health = s.get("server_config") or {}, s["health"]
    return (
        f"{health.get('device')} {health.get('dtype')}, scheduler {sc.get('scheduler')}, max_batch "
        f"{sc.get('max_batch')}, estimator {'fitted' if sc.get('estimator') else 'defaults'}"
    )


def held_rows(result: dict) -> list[dict]:
    """A row per system: its capacity at each class (as written) and its settings."""
    classes = result["config"]["classes"]
    return [
        {"system": SYSTEMS[name], **{str(c): cap_text(s.get("capacity", {}).get(str(c))) for c in classes}}
        | {"settings": _settings(name, s)}
        for name, s in result["systems"].items()
    ]


def held_by_class(result: dict) -> list[dict]:
    """A row per class: the robots each system held there (the plot's bars)."""
    systems = {n: s for n, s in result["systems"].items() if not s.get("skipped")}
    return [
        {"class": f"{c} tok/s per robot"}
        | {SYSTEMS[n]: (s.get("capacity", {}).get(str(c)) or {}).get("capacity", 0) for n, s in systems.items()}
        for c in result["config"]["classes"]
    ]


def _judged(j: dict) -> str:
    rate = lambda v: "-" if v is None else f"{100 * v:.0f}"  # noqa: E731
    return ", ".join(f"{c}: {rate(v['violation_rate'])} %" for c, v in j.items())


REPORT = harness.Report(
    "gpu_fleet",
    "# Robots per GPU: {gpu}, random {model[shape][name]} ({model[dtype]})",
    [
        harness.Table(
            held_rows,
            lambda r: [
                harness.Col("system"),
                *[harness.Col(str(c), f"{c} tok/s") for c in r["config"]["classes"]],
                harness.Col("settings"),
            ],
            "## Robots held",
            "'>= N': every fleet tried held (N is the largest tried; llama.cpp stops at "
            f"{LLAMA_MAX_ROBOTS} robots); '< N': the smallest fleet tried did not.",
        ),
        harness.Table(
            lambda r: [p for s in r["systems"].values() for p in s.get("points", [])],
            [
                harness.Col("system", fmt=SYSTEMS.get),
                harness.Col("n", "N"),
                harness.Col("classes", "judged at", lambda c: f"{', '.join(c)} tok/s"),
                harness.Col("judged", "violations", _judged),
                harness.Col("speed_mean", "speed mean tok/s", "{:.1f}"),
                harness.Col("speed_min", "speed min tok/s", "{:.1f}"),
                harness.Col("goodput_tokens_per_s", "goodput tok/s", "{:.1f}"),
                harness.Col("tokens_per_round", "tokens/round", "{:.2f}"),
                harness.Col("round_ms_mean", "round ms mean", "{:.0f}"),
                harness.Col("round_ms_p95", "p95", "{:.0f}"),
                harness.Col("sheds", "shed"),
                harness.Col("server_means", "server means", lambda m: ", ".join(f"{k} {v:.2f}" for k, v in m.items())),
                harness.Col("client_cpu", "client CPU", "{:.2f}"),
                harness.Col("exact", fmt=lambda e: "yes" if e else "**no**"),
            ],
            "## Points",
        ),
    ],
    harness.Plot(
        held_by_class,
        x="class",
        ys=lambda r: {SYSTEMS[n]: SYSTEMS[n] for n, s in r["systems"].items() if not s.get("skipped")},
        kind="bar",
        xlabel="",
        ylabel="robots held (<= 5 % of generations miss the rate)",
        title="Robots per GPU: {gpu}, random {model[shape][name]}",
    ),
    intro=_intro,
)


# --------------------------------------------------------------------------- main


def add_args(ap: argparse.ArgumentParser) -> None:
    settings.add_flags(ap, FleetConfig)
    ap.add_argument("--peer-binary", default=None, help="llama-server to use (default: the cached build of this kind)")
    ap.add_argument("--build-peer", action="store_true", help="build llama-server if none is cached (CUDA on cuda)")
    ap.add_argument("--model-dir", default=None, help="where the random target is cached (default models/build)")


def measure(args: argparse.Namespace) -> dict:
    if args.quick:  # the toy target on the CPU, one fleet of 1 per engine, no peer
        args.tiny, args.device, args.peer, args.ns, args.window_s, args.warmup_s = True, "cpu", False, (1,), 2.0, 1.0
    try:
        cfg = FleetConfig(**settings.given(FleetConfig, args))
    except ValueError as e:
        raise SystemExit(f"bench_gpu_fleet: {e}") from e
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def say(msg: str) -> None:
        el = int(time.monotonic() - t_start)
        print(f"[{el // 60:02d}:{el % 60:02d}] {msg}", flush=True)

    machine = machine_info()
    say(
        f"bench_gpu_fleet: {machine['gpu']['name'] if machine['gpu'] else 'no GPU'}, {machine['cpu_count']} cores; "
        f"config {json.dumps(asdict(cfg))}"
    )
    shape = random_target.TINY if cfg.tiny else random_target.LLAMA_7B
    target = random_target.make(shape, cfg.dtype, cfg.seed, args.model_dir, log=lambda m: say(m))
    recorded = Trace.load(TRACES / f"{cfg.pair}__smollm2-f32.json")
    if cfg.gamma > recorded.gamma_max:
        raise SystemExit(f"--gamma {cfg.gamma} exceeds the trace's recorded chains of {recorded.gamma_max}")
    gguf_hash = random_target.gguf_vocab_hash(target.gguf)
    if gguf_hash != recorded.vocab_hash:
        raise SystemExit(
            f"the random target's vocabulary ({gguf_hash[:12]}) is not the draft's "
            f"({recorded.vocab_hash[:12]}): robots would be refused"
        )
    successor = random_target.planted_successor(random_target.token_types(), cfg.seed)
    trace = replay_trace(recorded, successor, target.gguf.name)
    (out / "replay_trace.json").write_text(
        json.dumps(
            {
                "draft": trace.draft,
                "target": trace.target,
                "prompts": [
                    {"prompt_ids": p.prompt_ids, "target_ids": p.target_ids, "chains": p.chains} for p in trace.prompts
                ],
            }
        )
    )
    context = context_tokens(trace, cfg)
    bound = kv_bound(machine, shape, cfg.dtype, context) if cfg.device == "cuda" else None
    limit = max(cfg.ns) if cfg.ns else cfg.max_n
    max_n = max(1, min(limit, bound)) if bound is not None else limit
    tau = planned_tau(trace, cfg.gamma, cfg.tokens)
    say(
        f"robots replay {cfg.pair}: {tau:.2f} tokens a round planned at gamma {cfg.gamma} (the recorded pair's); "
        f"sessions of {context} tokens; fleets up to {max_n}" + (f" (KV room for {bound})" if bound else "")
    )
    cpus = {}
    every_cpu = os.sched_getaffinity(0)
    if cfg.device == "cpu" and len(every_cpu) >= 2:  # as tools/bench/loadgen.py: server and robots apart
        ordered = sorted(every_cpu)
        cpus = {"server": {ordered[1]}, "client": {ordered[0]}}
    result = {
        "config": asdict(cfg),
        "gpu": machine["gpu"]["name"] if machine["gpu"] else f"no GPU ({cfg.device})",
        "machine": machine,
        "model": target.describe(),
        "trace": {
            "pair": cfg.pair,
            "file": str(TRACES / f"{cfg.pair}__smollm2-f32.json"),
            "planned_tau": round(tau, 3),
            "vocab_hash": recorded.vocab_hash,
            "gguf_vocab_hash": gguf_hash,
        },
        "context_tokens": context,
        "kv_bound_sessions": bound,
        "max_n": max_n,
        "cpus": {k: sorted(v) for k, v in cpus.items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "systems": {},
    }
    if cpus:
        os.sched_setaffinity(0, cpus["client"])
    try:
        for engine in cfg.engines:
            say(f"SD on the {engine} engine")
            result["systems"][engine] = run_sd(cfg, engine, target, trace, max_n, out, cpus, say)
            REPORT.write(out, result)  # a long run leaves what it has
        if cfg.peer:
            say("llama-server, plain AR, --parallel N")
            binary = peer_binary(cfg, args.peer_binary, args.build_peer, say)
            if binary is None:
                result["systems"]["llama-server"] = {
                    "skipped": "no llama-server of this kind cached (--build-peer, "
                    "or make llama-server; on CUDA with LLAMA_FLAVOUR=cuda "
                    'LLAMA_CMAKE_ARGS="-DGGML_CUDA=on")'
                }
            else:
                result["systems"]["llama-server"] = run_peer(cfg, target, trace, max_n, binary, cpus, say)
    finally:
        os.sched_setaffinity(0, every_cpu)
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["exact"] = all(p["exact"] for s in result["systems"].values() for p in s.get("points", []))
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/gpu_fleet", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
