"""The server's one typed config: a TOML file, overridden from the command line, logged at start."""
from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from . import modelfiles
from .wire import DEFAULT_MAX_FRAME_BYTES


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    token: str = ""                 # shared secret checked in hello; "" = loopback clients only
    target: str = modelfiles.DEFAULT_TARGET
    threads: int = 0                # torch intra-op threads; 0 = torch's default
    max_sessions: int = 64          # session table bound; the least recently used is evicted
    max_sessions_per_connection: int = 8
    idle_timeout_s: float = 300.0   # sessions untouched this long are evicted
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_draft_len: int = 16
    max_context: int = 2048         # prompt + generated tokens per session
    max_connections: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        for name in ("max_sessions", "max_sessions_per_connection", "max_frame_bytes", "max_draft_len",
                     "max_context", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be > 0")
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
