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

from .engine import DTYPES, ENGINES
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
class ServerConfig:
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
    target: str = setting(
        modelfiles.DEFAULT_TARGET,
        help="The target: a name (smollm2-f32), a GGUF file or a Hugging Face model directory.",
    )
    engine: str = setting(
        "auto",
        choices=ENGINES,
        help="llamacpp (llama.cpp, no torch) or torch (any transformers model on any device); auto = llamacpp "
        "for a GGUF target, torch for a model directory.",
    )
    mmproj: str = setting(
        "",
        help="llamacpp: the target's vision projector (libmtmd's GGUF): robots may then send images (a torch "
        "VLM directory needs none: its processor and vision tower are in it).",
    )
    device: str = setting("auto", help="torch: auto (CUDA where present), cpu, cuda or cuda:N.")
    dtype: str = setting(
        "auto", choices=DTYPES, help="torch: auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16."
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
        "(off: faster batched passes on a GPU); auto = off when layers are offloaded and no exits are tapped.",
    )
    n_ubatch: int = setting(0, help="llamacpp: tokens per micro-batch; 0 = a whole call in one (exits need it).")
    flash_attn: str = setting(
        "auto", choices=("auto", "on", "off"), help="llamacpp: flash attention (auto: where the backend has it)."
    )
    threads: int = setting(0, help="Engine threads (llama.cpp or torch); 0 = the engine's default.")
    max_sessions: int = setting(
        64, help="The session table's bound; the least recently used idle one (detached first) is evicted."
    )
    max_sessions_per_connection: int = setting(8, help="Sessions one connection may hold.")
    max_sessions_per_client: int = setting(
        16,
        help="Sessions of one client (its address: server.client_key) over all its connections; beyond it its "
        "own least recently used idle one is evicted, or the open is refused (too_many_sessions). Raise it for "
        "many robots behind one NAT (behind HAProxy: set trusted_proxies).",
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
    max_connections: int = setting(256, help="Authenticated connections: a connection counts from its hello on.")
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
        help="Of those, from one client address (an IPv6 /64); beyond it a newcomer is closed at once (HTTP "
        "429 behind a trusted proxy). Raise it for many robots behind one NAT.",
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
        help="CIDRs of proxies (HAProxy) whose X-Forwarded-For names the client, e.g. 127.0.0.1/32 for one on "
        "this host: its address then decides the loopback rule, the per-address cap and the logs. "
        "[] = every peer is its own client (X-Forwarded-For ignored).",
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
    max_batch: int = setting(16, help="Sessions in one forward pass (1-1024).")
    max_queue: int = setting(128, help="Requests waiting for the target; a newcomer beyond it is shed (overloaded).")
    max_wait_ms: float = setting(
        3000.0, help="A request that waited longer is shed (overloaded): the robot's offline policy takes over."
    )
    batch_wait_ms: float = setting(
        50.0,
        help="fixed: how long the oldest waits for a full batch; slo: how long a free target may wait for a "
        "robot due back (never while a request is critical).",
    )
    guard_ms: float = setting(10.0, help="The guard time in each round's latest start (estimator error, jitter).")
    batch_memory_mb: int = setting(
        2048, help="One pass's padded KV and logits; a batch that would exceed it stops growing."
    )
    default_slo: float = setting(0.0, help="Tokens/s for sessions that open without an SLO class; 0 = best effort.")
    estimator: str = setting(
        "auto",
        help="The verification-time coefficients (JSON); auto = models/estimator/<target>.json "
        '(tools/train/profile_verifier.py); "" = rough defaults.',
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
        for name in ("max_batch", "max_queue", "batch_memory_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch > 1024:
            raise ValueError(f"max_batch must be <= 1024, got {self.max_batch}")
        for name in ("max_wait_ms", "batch_wait_ms", "guard_ms", "default_slo"):
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
