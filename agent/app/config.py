"""`edge-agent`'s one typed config: `run`'s TOML sections and `generate`'s flags, each a dataclass of settings.

Each field is declared once, with its type, default and help (`runtime.settings.setting`); the TOML
reader, the type errors, the `run` shortcuts (`--verifier`, ...), `generate`'s flags and
docs/guide/configuration.md are derived from these declarations. Every field of `run` can be
overridden on the command line with `--set section.field=value` (the value is read as TOML:
`--set safety.max_vx=0.3`, `--set camera.source="sim"`, `--set robot.options={port="/dev/ttyUSB0"}`,
or one key of a table: `--set robot.options.scene="red_box"`); the config in use is logged at start.
systemd/edge-agent.toml is the annotated example and holds every key.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from agent.decoding.link import ROBOT_ID
from agent.decoding.settings import DecoderSettings, DraftingSettings, DraftModelSettings, LinkSettings
from agent.robot.actions import FORWARD_CM, TURN_DEG
from agent.robot.controllers.base import CONTROLLERS
from agent.robot.safety import SafetyLimits
from protocol.payload import PayloadSpec
from runtime import settings
from runtime.settings import ConfigError, defaults, setting, tomllib

from .http_guard import valid_name
from .memory import check_memory

__all__ = ["Config", "ConfigError", "GenerateOptions", "load", "tomllib"]  # tomllib: tomli on Python 3.10

MODES = ("sd", "fsd", "ar")
OFFLINE_POLICIES = ("hold", "local")
PERCEPTION_KINDS = ("sim", "color", "vlm")


@dataclass(frozen=True)
class SamplingSettings:
    """How a generation samples and how long it may be: the robot's steps ([agent]) and `generate`'s prompt."""

    max_tokens: int = setting(64, help="Tokens to generate at most (a step's answer: one action fits in far fewer).")
    temperature: float = setting(0.0, help="0 = greedy: the same prompt (instruction and view) gives the same answer.")
    seed: int = setting(0, help="The sampling seed at temperature > 0.")


# A step's answer is about 23 tokens and the shipped pair agrees on ~96 % of them: 12 a round takes it in 2 rounds
# where 4 took 5 (docs/benchmarks/overlap: a step's generation 1.4 s instead of 1.9 s on the 2-core machine).
@dataclass(frozen=True)
@defaults(max_tokens=40, gamma=12)
class AgentSection(SamplingSettings, DraftingSettings, DraftModelSettings):
    """[agent]: the draft model and how the robot's steps decode (the decoder's parts), and the task's bounds."""

    max_plan_age_s: float = setting(5.0, help="Never act on a plan whose frame is older than this (s).")
    overlap: bool = setting(
        True,
        help="Think while moving: step k + 1 is decided during motion k and starts when motion k ends, if its plan "
        "is still fresh (false: look, decide, act, one after the other).",
    )
    overlap_look: str = setting(
        "end",
        choices=("end", "start"),
        help='Overlapped: what step k + 1 sees. "end": the frame at the start of motion k, its sightings and the '
        'range ahead moved to the pose motion k will reach (dead reckoning); "start": that frame as it is.',
    )
    reach_m: float = setting(0.6, help='"Within reach" in the observation text, and a reached target (m).')
    task_timeout_s: float = setting(
        60.0,
        flag="--max-wait-s",
        help="The most seconds a task may spend held (no plan made: the link down under offline.policy "
        '"hold", no fresh camera frame); held steps count toward this, not toward max_steps, and the task '
        'then ends "timeout".',
    )

    def __post_init__(self) -> None:
        settings.check_choices(self, "agent.")
        if self.mode not in MODES:
            raise ConfigError(f"agent.mode must be one of {', '.join(MODES)} (offline.policy says what runs offline)")
        if self.n_gpu_layers < -1:
            raise ConfigError(f"agent.n_gpu_layers must be -1 (all), 0 (CPU) or a layer count, got {self.n_gpu_layers}")
        if self.threads < 1 or self.gamma < 1 or self.max_tokens < 1:
            raise ConfigError("agent.threads, agent.gamma and agent.max_tokens must be >= 1")
        if not self.max_plan_age_s > 0:
            raise ConfigError(f"agent.max_plan_age_s must be positive, got {self.max_plan_age_s}")
        if not 0 < self.task_timeout_s <= 86400:
            raise ConfigError(f"agent.task_timeout_s must be 0..86400 s (and not 0), got {self.task_timeout_s}")
        if not 0 <= self.slo_tokens_per_s <= 1000:
            raise ConfigError(f"agent.slo_tokens_per_s must be 0..1000 tokens/s, got {self.slo_tokens_per_s}")
        try:
            PayloadSpec.parse(self.payload, self.topk)
        except ValueError as e:
            raise ConfigError(f"agent.payload / agent.topk: {e}") from None


# The robot's link: a dead link noticed in a second or two, one reconnect try a step (the robot holds or
# drafts alone meanwhile), where the library's defaults suit a command that waits.
@dataclass(frozen=True)
@defaults(
    verifier="",
    keepalive_s=1.0,
    verify_timeout_s=2.0,
    reconnect_attempts=1,
    reconnect_backoff_s=0.2,
    reconnect_backoff_max_s=5.0,
)
class LinkSection(LinkSettings):
    """[link]: the verifier's link (the decoder's part); the token is read from the variable token_env names."""

    token_env: str = setting("VERIFIER_TOKEN", help="The environment variable holding the verifier's token.")

    def __post_init__(self) -> None:
        verifier = self.verifier or ""
        if self.robot_id and not ROBOT_ID.fullmatch(self.robot_id):
            raise ConfigError(f"link.robot_id must be 1-64 of [A-Za-z0-9_.:-], got {self.robot_id!r}")
        if verifier and not verifier.startswith(("ws://", "wss://")):
            raise ConfigError(f"link.verifier must be a ws:// or wss:// URL, got {self.verifier!r}")
        if self.ca_file and not verifier.startswith("wss://"):
            raise ConfigError("link.ca_file is for a wss:// verifier")
        if not 0.1 <= self.keepalive_s <= 5.0:
            raise ConfigError(f"link.keepalive_s must be 0.1..5 s (1-2 s is right for a robot), got {self.keepalive_s}")
        if (
            self.verify_timeout_s <= 0
            or self.reconnect_backoff_s <= 0
            or self.reconnect_backoff_max_s < self.reconnect_backoff_s
        ):
            raise ConfigError("link timeouts must be positive and backoff_max >= backoff")
        if self.reconnect_attempts < 1:
            raise ConfigError(f"link.reconnect_attempts must be >= 1, got {self.reconnect_attempts}")


def check_envelope(max_forward_cm: float, max_turn_deg: float, speed_scale: float) -> None:
    if not FORWARD_CM[0] <= max_forward_cm <= FORWARD_CM[-1]:
        raise ValueError(
            f"offline.max_forward_cm must be {FORWARD_CM[0]}..{FORWARD_CM[-1]} cm (NaVILA's steps "
            f"are {FORWARD_CM}), got {max_forward_cm!r}"
        )
    if not TURN_DEG[0] <= max_turn_deg <= TURN_DEG[-1]:
        raise ValueError(
            f"offline.max_turn_deg must be {TURN_DEG[0]}..{TURN_DEG[-1]} degrees (NaVILA's steps "
            f"are {TURN_DEG}), got {max_turn_deg!r}"
        )
    if not 0 < speed_scale <= 1:
        raise ValueError(f"offline.speed_scale must be in (0, 1] (it slows unverified motion), got {speed_scale!r}")


@dataclass(frozen=True)
class OfflineSection:
    policy: str = setting(
        "hold",
        choices=OFFLINE_POLICIES,
        flag="--offline",
        help="With the verifier unreachable: hold (stop and wait) or local (the draft model alone, unverified).",
    )
    max_forward_cm: float = setting(
        25.0, help="local: an unverified forward step is at most this (25..75 cm; larger ones reduced to fit)."
    )
    max_turn_deg: float = setting(
        15.0,
        help="local: an unverified turn is at most this (15..45 degrees; larger ones reduced to fit); one "
        "away from a target in view stops.",
    )
    speed_scale: float = setting(0.5, help="local: unverified motion runs at this fraction of speed and turn rate.")

    def __post_init__(self) -> None:
        settings.check_choices(self, "offline.")
        try:
            check_envelope(self.max_forward_cm, self.max_turn_deg, self.speed_scale)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class NavSection:
    memory_steps: int = setting(
        4, help="The last steps of the task (seen, done, verified or not) in the prompt, 0..32; 0: none."
    )
    memory_max_tokens: int = setting(
        160, help="Their bound in draft tokens (~25 a step), 32..2048; the oldest go first."
    )
    grammar: bool = setting(
        True, help="Answers decoded under the NaVILA answer grammar on both sides: exact, never a parse miss."
    )
    feasible: bool = setting(
        True,
        help="The answer grammar holds only the actions the robot can take now (no forward move the obstacle stop "
        "would cut short, a turn after two that it did) and the prompt says what is left out and why "
        "(agent/robot/feasible.py); needs nav.grammar and a range source. With nav.grounded, nav_eval's episodes "
        "cut short none of their motions past a quarter (docs/benchmarks/navigation.md).",
    )
    grounded: bool = setting(
        True,
        help='The answer\'s reason opens with what the camera line says ("I do not see the" when nothing the '
        'instruction names is in view, else its side or "within reach"; agent/app/prompt.py grounded_openings), '
        "so a step cannot claim a target it was not shown; the action stays the target's choice. Needs nav.grammar; "
        'perception in words only (not "vlm").',
    )
    blocked_m: float = setting(
        0.0,
        help='The camera line says "the way ahead is blocked" when the range source reads less than this '
        "straight ahead, 0..5 m (0: never; off by default: an example of it in the prompt cost the memory "
        "cases, see agent/app/prompt.py blocked_text).",
    )

    def __post_init__(self) -> None:
        if not (isinstance(self.blocked_m, (int, float)) and 0 <= self.blocked_m <= 5):
            raise ConfigError(f"nav.blocked_m must be 0..5 m (0: never), got {self.blocked_m!r}")
        if not isinstance(self.grammar, bool):
            raise ConfigError(f"nav.grammar must be true or false, got {self.grammar!r}")
        for name in ("feasible", "grounded"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"nav.{name} must be true or false, got {getattr(self, name)!r}")
        try:
            check_memory(self.memory_steps, self.memory_max_tokens)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class RobotSection:
    controller: str = setting("sim", choices=tuple(CONTROLLERS), flag="--controller", help="The robot's driver.")
    control_hz: float = setting(
        20.0,
        help="The control loop's rate, 10..200 Hz (the Go2 wants Move at >= 10 Hz); it also sends "
        "WATCHDOG=1 to systemd.",
    )
    options: dict = setting(
        default_factory=dict,
        help='Passed to the controller\'s constructor: go2 network_interface = "eth0"; serial port = '
        '"/dev/ttyUSB0"; sim scene and start (--scene, --start).',
    )

    def __post_init__(self) -> None:
        settings.check_choices(self, "robot.")
        if not 10.0 <= self.control_hz <= 200.0:
            raise ConfigError(
                f"robot.control_hz must be 10..200 (the Go2 wants Move at >= 10 Hz), got {self.control_hz}"
            )
        if not isinstance(self.options, dict):
            raise ConfigError("robot.options must be a table")


# SafetyLimits is declared in agent/robot/safety.py, beside the layer that enforces it; its help is here.
SAFETY_HELP = {
    "max_vx": "m/s forward and backward, clipped before any command reaches the robot.",
    "max_vy": "m/s sideways.",
    "max_wz": "rad/s yaw rate.",
    "max_dvx": "m/s^2: the most vx may change per second.",
    "max_dvy": "m/s^2: the most vy may change per second.",
    "max_dwz": "rad/s^2: the most the yaw rate may change per second.",
    "deadman_s": "No fresh command for this long: send zero velocity (s).",
    "max_frame_age_s": "Act only on camera frames younger than this (s).",
    "min_clearance_m": "No translation toward an obstacle nearer than this (m; the Go2's range finder); 0 = off; "
    "unset = on wherever the controller has a range source.",
}


@dataclass(frozen=True)
class CameraSection:
    source: str = setting(
        "sim",
        flag="--camera",
        help="go2 (the Go2's front camera, over robot.options network_interface), a V4L2 device (/dev/videoN), "
        'a GStreamer pipeline (CSI: "nvarguscamerasrc ... ! appsink"), rtsp://..., a video file or sim.',
    )
    width: int = setting(640, help="Pixels requested from the source (>= 16).")
    height: int = setting(480, help="Pixels requested from the source (>= 16).")
    fps: int = setting(15, help="Frames per second requested from the source (1..120).")
    max_age_ms: float = setting(
        500.0,
        help="Never plan from an older frame; a camera silent this long is reported on systemctl status "
        "(STATUS=) and the API.",
    )

    def __post_init__(self) -> None:
        if self.width < 16 or self.height < 16 or not 1 <= self.fps <= 120 or self.max_age_ms <= 0:
            raise ConfigError("camera: width/height >= 16, fps 1..120, max_age_ms > 0")


@dataclass(frozen=True)
class PerceptionSection:
    kind: str = setting(
        "sim",
        choices=PERCEPTION_KINDS,
        flag="--perception",
        help="sim (the simulator's ground truth), color (a colour-blob target detector) or vlm (the camera "
        "image itself in the prompt: a vision-language draft with agent.draft_mmproj and a verifier served "
        "with --mmproj).",
    )
    target_height_m: float = setting(
        0.4, help="color: the target's real height, for a distance from its pixel height (m)."
    )
    image_max_side: int = setting(
        384, help="vlm: the longest side of the image sent, 16..4096 pixels (resized, aspect kept)."
    )
    jpeg_quality: int = setting(85, help="vlm: its JPEG quality, 1..100; the wire takes at most 1 MiB an image.")

    def __post_init__(self) -> None:
        settings.check_choices(self, "perception.")
        if not 16 <= self.image_max_side <= 4096:
            raise ConfigError(f"perception.image_max_side must be 16..4096 pixels, got {self.image_max_side!r}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConfigError(f"perception.jpeg_quality must be 1..100, got {self.jpeg_quality!r}")


@dataclass(frozen=True)
class BrowserGuard:
    """Who an HTTP endpoint on the robot lets in besides robot processes: the local API and openai_listen
    (the [api] keys) and `edge-agent serve` (its flags) declare these once, here."""

    allowed_origins: list = setting(
        default_factory=list,
        help='Browser Origins let in (e.g. "https://ui.robot.lan"); a request with any other Origin header is '
        "refused with 403.",
    )
    allowed_hosts: list = setting(
        default_factory=list,
        help='Host names (e.g. "go2.lan") a request over TCP may name in its Host header besides the address it '
        "reached; any other Host is refused with 421 (DNS rebinding).",
    )


@dataclass(frozen=True)
class ApiSection(BrowserGuard):
    listen: str = setting(
        "",
        flag="--listen",
        help='The local API (submit, cancel, status, estop, reset). "" = a Unix socket of mode 0600 at the '
        "default path ($RUNTIME_DIRECTORY/api.sock under systemd, else $XDG_RUNTIME_DIR/edge-agent/api.sock, "
        "else /tmp/edge-agent-$UID/api.sock); unix:/ABSOLUTE/PATH; or HOST:PORT (TCP: needs a token; an "
        "address other than loopback also allow_remote).",
    )
    socket_group: str = setting(
        "", help='Unix socket: a group whose members may use it too (mode 0660); "" = this user only (0600).'
    )
    allow_remote: bool = setting(
        False, help="TCP on an address other than loopback (with a token, over a trusted network only)."
    )
    token: str = setting(
        "", help="The credential every connection presents (Authorization: Bearer ...); prefer token_file."
    )
    token_file: str = setting("", help="A file holding that credential (its first line; not world-readable).")
    reset_token: str = setting(
        "",
        help='The credential a reset (which releases the e-stop) carries; "" with no reset_token_file: '
        "reset over the API is refused. Prefer reset_token_file.",
    )
    reset_token_file: str = setting(
        "", help="A file holding it (its first line; not world-readable; install.sh makes one)."
    )
    openai_listen: str = setting(
        "",
        help="HOST:PORT of an OpenAI-compatible endpoint (POST /v1/chat/completions, GET /v1/models) on the "
        'daemon\'s draft model, behind the same token (Authorization: Bearer); "" = none. Needs token or '
        "token_file; an address other than loopback also allow_remote. Chat answers and navigation steps take "
        "turns on the model.",
    )

    def __post_init__(self) -> None:
        self._check_openai()
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
        _check_origins("api.allowed_origins", self.allowed_origins)
        _check_hosts("api.allowed_hosts", self.allowed_hosts)

    def _check_openai(self) -> None:
        if not self.openai_listen:
            return
        if not is_loopback(_tcp_host("api.openai_listen", self.openai_listen)) and not self.allow_remote:
            raise ConfigError(f"api.openai_listen {self.openai_listen!r} is not loopback: set api.allow_remote = true")
        if not (self.token or self.token_file):
            raise ConfigError("api.openai_listen: set api.token_file (or api.token), the key its clients present")

    def secrets(self) -> tuple[str, str]:
        """(token, reset_token): inline or read from their files ("" when not configured); ConfigError when a
        file is missing, empty, too short, readable by every user, or both credentials are the same."""
        token = self.token or _read_secret("api.token_file", self.token_file)
        reset = self.reset_token or _read_secret("api.reset_token_file", self.reset_token_file)
        if token and token == reset:
            raise ConfigError("api.reset_token must differ from api.token: a reset needs a credential of its own")
        return token, reset


MIN_SECRET = 16  # characters of an API credential


def _check_hosts(name: str, hosts: Any) -> None:
    """A list of Host names: host names or IP addresses, without scheme or port."""
    if not isinstance(hosts, list) or not all(isinstance(h, str) and valid_name(h) for h in hosts):
        raise ConfigError(f'{name} must be a list of host names like "go2.lan" (no scheme, no port), got {hosts!r}')


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


def _tcp_host(name: str, value: str) -> str:
    """The host of a HOST:PORT listen address (the OpenAI endpoint's); ConfigError naming `name` otherwise."""
    try:
        where = parse_listen(value)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    if where[0] != "tcp":
        raise ConfigError(f"{name} is HOST:PORT, got {value!r}")
    return where[1]


def _check_secret(name: str, value: str) -> None:
    if len(value) < MIN_SECRET or value != value.strip():
        raise ConfigError(f"{name} must be at least {MIN_SECRET} characters without surrounding spaces")


def _check_origins(name: str, origins: object, any_scheme: bool = False) -> None:
    """A list of Origins, SCHEME://HOST[:PORT] (http or https unless any_scheme: an app's own, app://...)."""
    schemes = re.compile(r"[a-z][a-z0-9+.-]*://" if any_scheme else r"https?://")
    if not isinstance(origins, list) or not all(
        isinstance(o, str) and schemes.match(o) and o.count("/") == 2 for o in origins
    ):
        raise ConfigError(f'{name} must be a list of origins like "https://ui.robot.lan:8443", got {origins!r}')


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
    path: str = setting(
        "telemetry.jsonl",
        flag="--telemetry",
        help="One JSON line per step; a relative path is under the state directory ($STATE_DIRECTORY under "
        'systemd, else $XDG_STATE_HOME/edge-agent or ~/.local/state/edge-agent); "" for none.',
    )
    max_bytes: int = setting(50_000_000, help="The size cap of the telemetry file, in bytes.")


@dataclass(frozen=True)
class RecordSection:
    path: str = setting(
        "",
        flag="--record",
        help="Record the run as MCAP (ROS 2 messages: camera, perception, answer, action, cmd_vel, pose, path, "
        'safety, link; docs/guide/recording.md) to this file; "" for none. Needs the record extra.',
    )
    max_bytes: int = setting(
        2 * 1024**3,
        help="The size cap of the recording in bytes, its summary included: a step that would pass it stops the "
        "recording (said once in the log) and the file is closed readable.",
    )
    jpeg_quality: int = setting(80, help="The JPEG quality of the recorded camera frames (1..100).")
    foxglove: str = setting(
        "",
        flag="--foxglove",
        help='HOST:PORT: serve the same channels live to Foxglove (its WebSocket source); "" for none. Needs '
        "the record extra and a credential (foxglove_token_file); an address other than loopback also "
        "allow_remote. Foxglove opens ws://HOST:PORT/?token=TOKEN (docs/guide/recording.md).",
    )
    allow_remote: bool = setting(
        False, help="Serve Foxglove on an address other than loopback (whoever holds the credential sees the camera)."
    )
    foxglove_token: str = setting(
        "", help="The credential of the live view (?token=... in Foxglove's URL); prefer foxglove_token_file."
    )
    foxglove_token_file: str = setting("", help="A file holding that credential (its first line; not world-readable).")
    foxglove_origins: list = setting(
        default_factory=list,
        help='Browser Origins let in to the live view; none by default. "https://app.foxglove.dev" lets in '
        "Foxglove's web app; an upgrade with any other Origin header is refused with 403 (the log names it).",
    )

    def __post_init__(self) -> None:
        if self.max_bytes < 1024 * 1024:
            raise ConfigError(f"record.max_bytes must be at least 1 MiB, got {self.max_bytes!r}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConfigError(f"record.jpeg_quality must be 1..100, got {self.jpeg_quality!r}")
        if self.foxglove:
            host, port = self.foxglove_address()
            if not is_loopback(host) and not self.allow_remote:
                raise ConfigError(
                    f"record.foxglove {self.foxglove!r} is not loopback: anyone on the network would see the "
                    "robot's camera. Use 127.0.0.1:PORT (and an SSH tunnel), or set record.allow_remote = true"
                )
            if not (self.foxglove_token or self.foxglove_token_file):
                raise ConfigError(
                    "record.foxglove: set record.foxglove_token_file (or record.foxglove_token), the credential "
                    "Foxglove presents as ws://HOST:PORT/?token=TOKEN; without one any local user sees the camera"
                )
        if self.foxglove_token and self.foxglove_token_file:
            raise ConfigError("record.foxglove_token and record.foxglove_token_file: give one")
        if self.foxglove_token:
            _check_secret("record.foxglove_token", self.foxglove_token)
        _check_origins("record.foxglove_origins", self.foxglove_origins, any_scheme=True)

    def foxglove_credential(self) -> str:
        """The live view's credential, inline or read from its file; ConfigError when the file is missing,
        too short or readable by every user."""
        return self.foxglove_token or _read_secret("record.foxglove_token_file", self.foxglove_token_file)

    def foxglove_address(self) -> tuple[str, int]:
        """record.foxglove as (host, port); ConfigError when it is not HOST:PORT."""
        host, _, port = self.foxglove.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"record.foxglove must be HOST:PORT, got {self.foxglove!r}")
        return (host[1:-1] if host.startswith("[") else host), int(port)


@dataclass(frozen=True)
class Config:
    """`edge-agent run`'s config: one section dataclass per TOML table."""

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
    record: RecordSection = RecordSection()

    def __post_init__(self) -> None:
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


SECTIONS: dict[str, Any] = {f.name: type(f.default) for f in fields(Config)}  # section name -> its dataclass
NOTES = {"safety": SAFETY_HELP}  # help for the sections declared elsewhere


def build(data: dict) -> Config:
    """TOML sections -> Config; ConfigError names an unknown section or key and a value of the wrong type."""
    return settings.build_tree(Config, data)


def parse_override(item: str) -> tuple[str, str, Any]:
    """ "section.field=value" -> (section, field, value); the value is TOML, else a bare string."""
    key, sep, raw = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or section not in SECTIONS:
        raise ConfigError(f"--set wants section.field=value with a section of {sorted(SECTIONS)}, got {item!r}")
    return section, name.strip(), settings.parse_value(raw)


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- the TOML file <- `--set section.field=value` overrides, in their order."""
    data: dict = settings.load_toml(path) if path is not None else {}
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


def shortcut_flags() -> list[tuple[str, str, Any]]:
    """(section, field, its Field) of every field `edge-agent run` takes as a flag of its own (`--verifier`)."""
    return [(s, f.name, f) for s, cls in SECTIONS.items() for f in fields(cls) if f.metadata.get("flag")]


# ------------------------------------------------------------------ edge-agent generate


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(SamplingSettings, DecoderSettings):
    """`edge-agent generate`'s flags: one prompt, decoded once (the field name with dashes is the flag); the
    decoder's settings are DecoderSettings' own (agent/decoding/settings.py), inherited."""

    prompt: str = setting(help="The prompt.")
    chat: bool = setting(False, help="Wrap the prompt in the model's chat template.")
    top_k: int = setting(0, help="Sample among the K most likely tokens; 0 = all.")
    top_p: float = setting(
        1.0, help="Sample within the nucleus: the most likely tokens whose mass reaches P, in (0, 1]; 1 = all."
    )
    local: bool = setting(False, help="Generate with the draft alone (offline): --mode local.")
    image: list[str] = setting(
        default_factory=list,
        repeat=True,
        metavar="FILE",
        help="A JPEG or PNG for the prompt (repeatable; needs --draft-mmproj and a target that reads images): "
        "on the prompt's image markers, in front of it, or with --chat in the user turn.",
    )
    json: bool = setting(False, help="The last stdout line: one JSON object with the text and the metrics.")


# ------------------------------------------------------------------ edge-agent serve (the OpenAI endpoint)


@dataclass(frozen=True)
@defaults(reconnect_attempts=2)  # a request waits little before the offline answer
class ServeOptions(BrowserGuard, DecoderSettings):
    """`edge-agent serve`'s flags: the OpenAI-compatible endpoint alone, without the robot
    (agent/app/openai_api.py; the field name with dashes is the flag); the decoder's settings inherited."""

    listen: str = setting("127.0.0.1:8080", help="HOST:PORT the endpoint listens on (port 0: any free port).")
    api_key: str = setting("", help="The key clients send as 'Authorization: Bearer KEY'; prefer --api-key-file.")
    api_key_file: str = setting("", help="A file holding that key (its first line; not world-readable).")
    offline: str = setting(
        "refuse",
        choices=("refuse", "local"),
        help="Without the verifier: refuse (503 verifier_unavailable) or answer with the draft alone, marked "
        '"verified": false; a request\'s own "offline" field overrides it.',
    )
    max_pending: int = setting(4, help="Requests running or waiting for the model at once; more get 503.")
    model_name: str = setting("", help='The model id /v1/models lists ("": the draft\'s name).')

    def __post_init__(self) -> None:
        host = _tcp_host("--listen", self.listen)
        if self.api_key and self.api_key_file:
            raise ConfigError("--api-key and --api-key-file: give one (the file keeps it off the command line)")
        if self.api_key:
            _check_secret("--api-key", self.api_key)
        if not is_loopback(host) and not (self.api_key or self.api_key_file):
            raise ConfigError(f"--listen {self.listen!r} is not loopback: set --api-key-file so not anyone may ask")
        if not 1 <= self.max_pending <= 256:
            raise ConfigError("--max-pending is from 1 to 256")
        if self.mode == "local":
            raise ConfigError("--mode local: use --offline local (and no --verifier) for the draft alone")
        _check_hosts("--allowed-hosts", self.allowed_hosts)
        _check_origins("--allowed-origins", self.allowed_origins)

    def key(self) -> str:
        """The API key: --api-key, or the first line of --api-key-file; "" for none."""
        return self.api_key or _read_secret("--api-key-file", self.api_key_file)
