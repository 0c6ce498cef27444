"""The server's one typed config: a TOML file, overridden from the command line, logged at start."""

from __future__ import annotations

import re

try:
    import tomllib  # novm: 3.11+, with the fallback below (CI: vermin)
except ImportError:  # Python 3.10 (JetPack 6, ROS 2 Humble): the same parser, as a package
    import tomli as tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from protocol import modelfiles
from protocol.wire import DEFAULT_MAX_FRAME_BYTES

from .engine import DTYPES, ENGINES
from .outbox import POLICIES as EXIT_POLICIES
from .scheduler import POLICIES as SCHEDULERS

AUTO_KV_TOKENS = 32768  # 1.4 GiB of float32 KV for SmolLM2-135M; set kv_tokens on a big server


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    token: str = ""  # shared secret checked in hello; "" = loopback clients only
    tls_cert: str = ""  # PEM certificate chain: serve wss:// (robots set link.ca_file to its CA)
    tls_key: str = ""  # its PEM private key; both or neither
    target: str = modelfiles.DEFAULT_TARGET
    engine: str = "auto"  # llamacpp | torch; auto = llamacpp for a GGUF target, torch for a HF directory
    mmproj: str = ""  # llamacpp: the target's vision projector (libmtmd's GGUF): robots may then send
    # images (a torch VLM directory needs none: its processor and vision tower are in it)
    device: str = "auto"  # torch: auto | cpu | cuda[:N] (auto: CUDA where present)
    dtype: str = "auto"  # torch: auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, else f32)
    n_gpu_layers: int = -1  # llamacpp: layers offloaded to the GPU; -1 = all when the build supports it
    kv_tokens: int = 0  # KV memory in tokens over all sessions; 0 = max_sessions x max_context, at most
    # AUTO_KV_TOKENS (llamacpp: the context's cells, shared by every session; torch:
    # slots of max_context each). A pass that finds no room is shed (`overloaded`)
    kv_type: str = "f16"  # llamacpp: KV element type, f16 (llama.cpp's default: 17 vs 24 ms per token
    # here, docs/engine) or f32
    kv_unified: str = "auto"  # llamacpp: one KV pool for every session (on) or a stream of kv_tokens /
    # max_sessions cells each (off: faster batched passes on a GPU); auto = off when
    # layers are offloaded and no exits are tapped
    n_ubatch: int = 0  # llamacpp: tokens per micro-batch; 0 = a whole call in one (exits need it)
    flash_attn: str = "auto"  # llamacpp: flash attention auto | on | off (auto: where the backend has it)
    threads: int = 0  # engine threads; 0 = the engine's default
    max_sessions: int = 64  # session table bound; the least recently used idle one (detached first) is evicted
    max_sessions_per_connection: int = 8
    max_sessions_per_client: int = 16  # sessions of one client (its address: server.client_key) over all its
    # connections; beyond it its own least recently used idle one is evicted, or the open is refused
    # (too_many_sessions). One credential cannot hold the table: a full server evicts the least recently used
    # idle session (detached first) before it refuses a robot. Raise it for many robots behind one NAT
    idle_timeout_s: float = 300.0  # sessions untouched this long are evicted
    # More than one replica (deploy/haproxy, deploy/k8s, tools/cluster/fleet.py)
    replica_id: str = ""  # this replica's name in welcome, opened, /healthz and /metrics' `replica` label;
    # "" = HOST:PORT (a pod's hostname is its name)
    detached_grace_s: float = 60.0  # a session whose connection closed keeps its KV this long for a robot that
    # comes back after a blip (then, or when idle_timeout_s is sooner, it goes)
    drain_timeout_s: float = 30.0  # SIGTERM drains: /healthz 503, no new robots, rounds in flight finish, each
    # connection closes with 1012 once idle; at most this long, then everything closes
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_draft_len: int = 16
    max_context: int = 2048  # prompt + generated tokens per session
    max_connections: int = 256  # authenticated connections: a connection counts from its hello on
    # Peers before hello (DESIGN.md, Trust; server_bridge/peers.py). A connection is unauthenticated from
    # its TCP accept until its hello passes; any error before then closes it (1008).
    hello_timeout_s: float = 5.0  # hello must have passed this long after the TCP accept, or the connection is
    # closed (1008); a TLS handshake gets as long again before that
    max_unauthenticated: int = 64  # unauthenticated connections over all peers; a newcomer beyond it evicts the
    # oldest (silent connections age out instead of locking robots out)
    max_unauthenticated_per_address: int = 8  # of those, from one client address (an IPv6 /64); beyond it a
    # newcomer is closed at once (HTTP 429 behind a trusted proxy). Raise it for many robots behind one NAT
    trust_loopback: bool | None = None  # loopback clients need no token and skip the two caps above. None =
    # true without a token (a tokenless server serves this host only), false with one: then everyone,
    # loopback and a same-host proxy's clients included, presents it. A request that carries a forwarding
    # header (X-Forwarded-For, Forwarded, X-Real-IP) from a peer outside trusted_proxies is never loopback
    trusted_proxies: list[str] = field(default_factory=list)  # CIDRs of proxies (HAProxy) whose X-Forwarded-For
    # names the client: its address then decides the loopback rule, the per-address cap and the logs.
    # [] = every peer is its own client (X-Forwarded-For ignored)
    metrics_listen: str = ""  # "HOST:PORT": also serve /metrics and the full /healthz there, plain HTTP, no
    # token (bind it to a private interface; "" = off). On the main port, with a token set, /metrics and the
    # full /healthz need `Authorization: Bearer <token>`; without it /healthz answers only
    # {"status": "ok"|"draining"} (200/503: balancer checks and Kubernetes probes) and /metrics 401
    log_lines_per_10s: int = 20  # log lines per connection (and for all unauthenticated peers together) in
    # 10 s; the rest are counted (bridge_log_lines_suppressed_total) and reported in one line
    # Early exits (FSD): verdicts from adapters inside the target, streamed before each result.
    exits: str = "auto"  # adapters' path prefix; "auto" = models/exits/<target> if trained, "" = off
    exit_layers: list[int] = field(default_factory=list)  # the exits to load; [] = every trained one
    exit_policy: str = "priority"  # per-connection outbox: priority (by confidence), fifo or random
    exit_queue: int = 64  # exit messages pending per connection; when full the least valuable drops
    exit_bonus_candidates: int = 16  # ids the later exits score at the bonus row (after one full-head row)
    # Batched verification (server_bridge/scheduler.py, batcher.py)
    scheduler: str = "slo"  # slo (WISP Algorithm 1) | fcfs (one at a time) | fixed (max_batch, arrival order)
    max_batch: int = 16  # sessions in one forward pass
    max_queue: int = 128  # requests waiting for the target; a newcomer beyond it is shed (`overloaded`)
    max_wait_ms: float = 3000.0  # a request that waited longer is shed (`overloaded`): the robot falls back
    batch_wait_ms: float = 50.0  # fixed: how long the oldest waits for a full batch; slo: how long a free target
    # may wait for a robot due back (never while a request is critical)
    guard_ms: float = 10.0  # delta in the latest start time (estimation error, queueing jitter)
    batch_memory_mb: int = 2048  # one pass's padded KV and logits; a batch that would exceed it stops growing
    default_slo: float = 0.0  # tokens/s for sessions that open without an slo; 0 = best effort
    estimator: str = "auto"  # verification-time coefficients (JSON); "auto" = models/estimator/<target>.json

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
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.kv_type not in ("f16", "f32"):
            raise ValueError(f"kv_type must be f16 or f32, got {self.kv_type!r}")
        if self.kv_unified not in ("auto", "on", "off") or self.flash_attn not in ("auto", "on", "off"):
            raise ValueError(
                f"kv_unified and flash_attn must be auto, on or off, got {self.kv_unified!r} and {self.flash_attn!r}"
            )
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
        if self.exit_policy not in EXIT_POLICIES:
            raise ValueError(f"exit_policy must be one of {', '.join(EXIT_POLICIES)}, got {self.exit_policy!r}")
        if not 1 <= self.exit_queue <= 4096:
            raise ValueError(f"exit_queue must be 1-4096, got {self.exit_queue}")
        if not 1 <= self.exit_bonus_candidates <= 1024:
            raise ValueError(f"exit_bonus_candidates must be 1-1024, got {self.exit_bonus_candidates}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
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
        """Defaults <- TOML file (table [server] or top level) <- overrides that are not None."""
        values: dict[str, Any] = {}
        if path:
            data = tomllib.loads(Path(path).read_text())
            values.update(data.get("server", data))
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown server config keys: {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def redacted(self) -> dict:
        d = asdict(self)
        d["token"] = "***" if self.token else ""
        return d
