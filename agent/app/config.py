"""`edge-agent run`'s one typed config: TOML sections, each a frozen dataclass validated on creation.

Every field can be overridden on the command line with `--set section.field=value`
(the value is read as TOML: `--set safety.max_vx=0.3`, `--set camera.source="sim"`,
`--set robot.options={port="/dev/ttyUSB0"}`, or one key of a table: `--set robot.options.scene="red_box"`);
the config in use is logged at start.
systemd/edge-agent.toml is the annotated example.
"""

from __future__ import annotations

try:
    import tomllib  # novm: 3.11+, with the fallback below (CI: vermin)
except ImportError:  # Python 3.10 (JetPack 6, ROS 2 Humble): the same parser, as a package
    import tomli as tomllib
import ipaddress
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from agent.robot.controllers.base import CONTROLLERS
from agent.robot.safety import SafetyLimits
from agent.spec.link import ROBOT_ID
from agent.spec.policy import POLICIES
from protocol.payload import DEFAULT_KIND, DEFAULT_TOPK, PayloadSpec

from .memory import check_memory
from .navigator import OFFLINE_POLICIES, check_envelope


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class AgentSection:
    draft: str = "smollm2-q4_1"  # draft name or a GGUF path
    draft_mmproj: str = ""  # the draft's vision projector (GGUF, libmtmd): a vision-language draft;
    # perception.kind = "vlm" needs it; "" = a text draft
    threads: int = 2
    n_gpu_layers: int = -1  # draft layers on the GPU: -1 all when llama.cpp can offload (a CUDA build on
    # the Orin), else none; 0 keeps the draft on the CPU
    mode: str = "sd"  # sd | fsd | ar (how verified steps decode)
    draft_policy: str = "fixed"
    gamma: int = 4
    max_tokens: int = 40
    temperature: float = 0.0
    seed: int = 0
    payload: str = DEFAULT_KIND  # none | full | topk | split: the uplink's q at temperature > 0
    topk: int = DEFAULT_TOPK  # K of payload topk
    max_plan_age_s: float = 5.0  # never act on a plan whose frame is older
    reach_m: float = 0.6
    slo_tokens_per_s: float = 0.0  # the verifier's SLO class: tokens/s this robot needs; 0 = best effort

    def __post_init__(self):
        if self.mode not in ("sd", "fsd", "ar"):
            raise ConfigError(f"agent.mode must be sd, fsd or ar, got {self.mode!r}")
        if self.draft_policy not in POLICIES:
            raise ConfigError(f"agent.draft_policy must be one of {POLICIES}, got {self.draft_policy!r}")
        if self.n_gpu_layers < -1:
            raise ConfigError(f"agent.n_gpu_layers must be -1 (all), 0 (CPU) or a layer count, got {self.n_gpu_layers}")
        if self.threads < 1 or self.gamma < 1 or self.max_tokens < 1:
            raise ConfigError("agent.threads, agent.gamma and agent.max_tokens must be >= 1")
        if not 0 <= self.slo_tokens_per_s <= 1000:
            raise ConfigError(f"agent.slo_tokens_per_s must be 0..1000 tokens/s, got {self.slo_tokens_per_s}")
        try:
            PayloadSpec.parse(self.payload, self.topk)
        except ValueError as e:
            raise ConfigError(f"agent.payload / agent.topk: {e}") from None


@dataclass(frozen=True)
class LinkSection:
    verifier: str = ""  # wss://HOST:PORT of server-bridge (ws:// on loopback); "" means always offline
    token_env: str = "VERIFIER_TOKEN"  # the shared secret is read from this environment variable
    ca_file: str = ""  # wss://: the CA (PEM) that signed the server's certificate; "" = the system's
    allow_insecure: bool = False  # send the token over plain ws:// to another host (a lab network only)
    keepalive_s: float = 1.0  # websocket ping interval and timeout (websockets' default is 20 s)
    verify_timeout_s: float = 2.0  # an answer later than this counts as a lost link
    reconnect_backoff_s: float = 0.2
    reconnect_backoff_max_s: float = 5.0
    robot_id: str = ""  # X-Robot-Id in the handshake, which a balancer hashes to keep this robot on
    # one replica; "" = robot-<hash of /etc/machine-id>, stable across reboots

    def __post_init__(self):
        if self.robot_id and not ROBOT_ID.fullmatch(self.robot_id):
            raise ConfigError(f"link.robot_id must be 1-64 of [A-Za-z0-9_.:-], got {self.robot_id!r}")
        if self.verifier and not self.verifier.startswith(("ws://", "wss://")):
            raise ConfigError(f"link.verifier must be a ws:// or wss:// URL, got {self.verifier!r}")
        if self.ca_file and not self.verifier.startswith("wss://"):
            raise ConfigError("link.ca_file is for a wss:// verifier")
        if not 0.1 <= self.keepalive_s <= 5.0:
            raise ConfigError(f"link.keepalive_s must be 0.1..5 s (1-2 s is right for a robot), got {self.keepalive_s}")
        if (
            self.verify_timeout_s <= 0
            or self.reconnect_backoff_s <= 0
            or self.reconnect_backoff_max_s < self.reconnect_backoff_s
        ):
            raise ConfigError("link timeouts must be positive and backoff_max >= backoff")


@dataclass(frozen=True)
class OfflineSection:
    policy: str = "hold"  # hold: stop and wait | local: the draft model alone, unverified
    max_forward_cm: float = 25.0  # local: an unverified forward step is at most this (25..75; reduced to fit)
    max_turn_deg: float = 15.0  # local: an unverified turn is at most this (15..45; reduced to fit)
    speed_scale: float = 0.5  # local: unverified motion runs at this fraction of speed and turn rate

    def __post_init__(self):
        if self.policy not in OFFLINE_POLICIES:
            raise ConfigError(f"offline.policy must be one of {OFFLINE_POLICIES}, got {self.policy!r}")
        try:
            check_envelope(self.max_forward_cm, self.max_turn_deg, self.speed_scale)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class NavSection:
    memory_steps: int = 4  # the last steps of the task (seen, done, verified) in the prompt; 0: none
    memory_max_tokens: int = 160  # their bound in draft tokens (~25 a step); the oldest go first
    grammar: bool = True  # answers under the NaVILA answer grammar on both sides (exact; never a miss)
    blocked_m: float = 0.0  # the camera line says "the way ahead is blocked" when the range source reads
    # less than this straight ahead (0: never; off by default: an example of
    # it in the prompt cost the memory cases, see agent/app/prompt.py blocked_text)

    def __post_init__(self):
        if not (isinstance(self.blocked_m, (int, float)) and 0 <= self.blocked_m <= 5):
            raise ConfigError(f"nav.blocked_m must be 0..5 m (0: never), got {self.blocked_m!r}")
        if not isinstance(self.grammar, bool):
            raise ConfigError(f"nav.grammar must be true or false, got {self.grammar!r}")
        try:
            check_memory(self.memory_steps, self.memory_max_tokens)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class RobotSection:
    controller: str = "sim"  # sim | serial | go2 | ros2
    control_hz: float = 20.0
    options: dict = field(default_factory=dict)  # passed to the controller's constructor

    def __post_init__(self):
        if self.controller not in CONTROLLERS:
            raise ConfigError(f"robot.controller must be one of {sorted(CONTROLLERS)}, got {self.controller!r}")
        if not 10.0 <= self.control_hz <= 200.0:
            raise ConfigError(
                f"robot.control_hz must be 10..200 (the Go2 wants Move at >= 10 Hz), got {self.control_hz}"
            )
        if not isinstance(self.options, dict):
            raise ConfigError("robot.options must be a table")


@dataclass(frozen=True)
class CameraSection:
    source: str = "sim"  # go2 | sim | /dev/videoN | a GStreamer pipeline | rtsp://... | a video file
    width: int = 640
    height: int = 480
    fps: int = 15
    max_age_ms: float = 500.0  # never plan from an older frame

    def __post_init__(self):
        if self.width < 16 or self.height < 16 or not 1 <= self.fps <= 120 or self.max_age_ms <= 0:
            raise ConfigError("camera: width/height >= 16, fps 1..120, max_age_ms > 0")


PERCEPTION_KINDS = ("sim", "color", "vlm")


@dataclass(frozen=True)
class PerceptionSection:
    kind: str = "sim"  # sim (simulator ground truth) | color (HSV blob detector) | vlm (the frame
    # itself in the prompt: a vision-language draft and target)
    target_height_m: float = 0.4  # color: the objects' real height, for distance
    image_max_side: int = 384  # vlm: the longest side of the image sent, in pixels (resized, aspect kept)
    jpeg_quality: int = 85  # vlm: its JPEG quality, 1..100

    def __post_init__(self):
        if self.kind not in PERCEPTION_KINDS:
            raise ConfigError(f"perception.kind must be one of {PERCEPTION_KINDS}, got {self.kind!r}")
        if not 16 <= self.image_max_side <= 4096:
            raise ConfigError(f"perception.image_max_side must be 16..4096 pixels, got {self.image_max_side!r}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConfigError(f"perception.jpeg_quality must be 1..100, got {self.jpeg_quality!r}")


@dataclass(frozen=True)
class ApiSection:
    listen: str = ""  # "" = a Unix socket at the default path (agent/app/api.py default_socket: $RUNTIME_DIRECTORY/
    # api.sock under systemd, else $XDG_RUNTIME_DIR/edge-agent/api.sock, else /tmp/edge-agent-$UID/api.sock);
    # unix:/ABSOLUTE/PATH; or HOST:PORT (TCP: needs a token; a non-loopback HOST also allow_remote)
    socket_group: str = ""  # Unix socket: "" = mode 0600 (the daemon's user only); a group name = 0660, that group
    allow_remote: bool = False  # TCP on an address other than loopback (with a token, over a trusted network only)
    token: str = ""  # the API credential every connection presents (Authorization: Bearer ...); prefer token_file
    token_file: str = ""  # a file holding that credential (its first line; not world-readable)
    reset_token: str = ""  # the credential a reset (which releases the e-stop) carries; "" with no reset_token_file:
    # reset over the API is refused
    reset_token_file: str = ""  # a file holding it (its first line; not world-readable)
    allowed_origins: list = field(default_factory=list)  # browser Origins let in (e.g. "https://ui.robot.lan");
    # an upgrade with any other Origin header is refused with 403

    def __post_init__(self):
        try:
            where = parse_listen(self.listen)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("token", "reset_token"):
            inline, path = getattr(self, name), getattr(self, f"{name}_file")
            if inline and path:
                raise ConfigError(f"api.{name} and api.{name}_file: give one (the file keeps it out of the TOML)")
            if inline:
                _check_secret(f"api.{name}", inline)
        if self.token and self.token == self.reset_token:
            raise ConfigError("api.reset_token must differ from api.token: a reset needs a credential of its own")
        if self.socket_group and where[0] != "unix":
            raise ConfigError("api.socket_group is for a Unix socket (api.listen unix:PATH or the default)")
        if where[0] == "tcp":
            host = where[1]
            if not is_loopback(host) and not self.allow_remote:
                raise ConfigError(
                    f"api.listen {self.listen!r} is not loopback: anyone on the network could drive the robot. "
                    "Keep the default Unix socket, or set api.allow_remote = true with api.token_file"
                )
            if not (self.token or self.token_file):
                raise ConfigError(
                    f"api.listen {self.listen!r} is TCP: set api.token_file (or api.token), which every client "
                    "presents as 'Authorization: Bearer TOKEN', or keep the default Unix socket"
                )
        if not isinstance(self.allowed_origins, list) or not all(
            isinstance(o, str) and o.startswith(("http://", "https://")) and o.count("/") == 2
            for o in self.allowed_origins
        ):
            raise ConfigError(
                f'api.allowed_origins must be a list of origins like "https://ui.robot.lan:8443", '
                f"got {self.allowed_origins!r}"
            )

    def secrets(self) -> tuple[str, str]:
        """(token, reset_token): inline or read from their files ("" when not configured); ConfigError when a
        file is missing, empty, too short, readable by every user, or both credentials are the same."""
        token = self.token or _read_secret("api.token_file", self.token_file)
        reset = self.reset_token or _read_secret("api.reset_token_file", self.reset_token_file)
        if token and token == reset:
            raise ConfigError("api.reset_token must differ from api.token: a reset needs a credential of its own")
        return token, reset


MIN_SECRET = 16  # characters of an API credential


def parse_listen(listen: str) -> tuple:
    """api.listen -> ("unix", PATH) with PATH "" for the default socket, or ("tcp", HOST, PORT)."""
    if listen == "":
        return ("unix", "")
    if listen.startswith("unix:"):
        path = listen[5:]
        if not path.startswith("/"):
            raise ValueError(f"api.listen unix:PATH wants an absolute path, got {listen!r}")
        return ("unix", path)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f'api.listen must be unix:PATH or HOST:PORT (or "" for the default socket), got {listen!r}')
    return ("tcp", host[1:-1] if host.startswith("[") else host, int(port))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False


def _check_secret(name: str, value: str) -> None:
    if len(value) < MIN_SECRET or value != value.strip():
        raise ConfigError(f"{name} must be at least {MIN_SECRET} characters without surrounding spaces")


def _read_secret(name: str, path: str) -> str:
    if not path:
        return ""
    try:
        if os.stat(path).st_mode & 0o004:
            raise ConfigError(f"{name} {path} is readable by every user: chmod o-r (0600 or 0640)")
        with open(path) as f:
            value = f.readline().strip()
    except OSError as e:
        raise ConfigError(f"{name}: cannot read {path}: {e.strerror}") from None
    _check_secret(f"{name} ({path})", value)
    return value


@dataclass(frozen=True)
class TelemetrySection:
    path: str = "telemetry.jsonl"  # "" for none
    max_bytes: int = 50_000_000


@dataclass(frozen=True)
class Config:
    agent: AgentSection = AgentSection()
    link: LinkSection = LinkSection()
    offline: OfflineSection = OfflineSection()
    nav: NavSection = NavSection()
    robot: RobotSection = RobotSection()
    safety: SafetyLimits = SafetyLimits()
    camera: CameraSection = CameraSection()
    perception: PerceptionSection = PerceptionSection()
    api: ApiSection = ApiSection()
    telemetry: TelemetrySection = TelemetrySection()

    def __post_init__(self):
        if self.camera.source == "sim" and self.robot.controller != "sim":
            raise ConfigError("camera.source 'sim' renders the simulator: it needs robot.controller = 'sim'")
        if self.perception.kind == "sim" and self.robot.controller != "sim":
            raise ConfigError("perception.kind 'sim' reads the simulator's ground truth: use 'color' on a robot")
        if self.perception.kind == "vlm" and not self.agent.draft_mmproj:
            raise ConfigError(
                "perception.kind 'vlm' shows the camera image to the models: it needs "
                "agent.draft_mmproj, the draft's vision projector (GGUF), beside a vision-language "
                "agent.draft (and a verifier served with --mmproj)"
            )

    def to_dict(self) -> dict:
        """The config as logged at start and saved beside results: inline API credentials shown as "<set>"."""
        d = asdict(self)
        for key in ("token", "reset_token"):
            if d["api"][key]:
                d["api"][key] = "<set>"
        return d


_TYPES = {f.name: type(f.default) for f in fields(Config)}  # section name -> its dataclass


def _section(name: str, values: dict):
    cls = _TYPES[name]
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"[{name}] has no field(s) {sorted(unknown)}; known: {sorted(known)}")
    defaults = cls()
    for key, value in values.items():  # the type each field's default has
        want = type(getattr(defaults, key))
        ok = (
            (isinstance(value, (int, float)) and not isinstance(value, bool))
            if want in (int, float)
            else (value is None or isinstance(value, (int, float)))
            if getattr(defaults, key) is None
            else isinstance(value, want)
        )
        if not ok:
            raise ConfigError(f"{name}.{key} must be {want.__name__}, got {value!r}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{name}]: {e}") from None


def build(data: dict) -> Config:
    unknown = set(data) - set(_TYPES)
    if unknown:
        raise ConfigError(f"unknown config section(s) {sorted(unknown)}; known: {sorted(_TYPES)}")
    return Config(**{name: _section(name, values) for name, values in data.items()})


def parse_override(item: str) -> tuple[str, str, object]:
    """ "section.field=value" -> (section, field, value); the value is TOML, else a bare string."""
    key, sep, raw = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or section not in _TYPES:
        raise ConfigError(f"--set wants section.field=value with a section of {sorted(_TYPES)}, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, name.strip(), value


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
    for item in overrides:
        section, name, value = parse_override(item)
        field_name, dot, key = name.partition(".")
        if not dot:
            data.setdefault(section, {})[name] = value
            continue
        table = data.setdefault(section, {}).setdefault(field_name, {})  # one key of a table field
        if not isinstance(table, dict) or not key:
            raise ConfigError(f"--set {section}.{name}: {section}.{field_name} is not a table")
        table[key] = value
    return build(data)
