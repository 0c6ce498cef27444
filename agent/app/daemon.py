"""`edge-agent run`: the robot daemon systemd supervises.

Threads, each with one job:
    control   the control loop (agent/robot/control.py): motors, deadman, WATCHDOG=1
    grabber   the camera, newest frame only (agent/robot/camera.py)
    nav       runs submitted instructions step by step (agent/app/navigator.py), one task at a time
    main      asyncio: the local API (agent/app/api.py) and the signal handlers

Start-up order: controller (a Go2 is checked for sport mode and stood up), camera,
control loop, draft model (and predictor), a first probe of the verifier (the robot
comes up offline if it is down), then READY=1. Shutdown (SIGTERM/SIGINT): STOPPING=1,
cancel the task, stop the motors, stop the threads, disconnect.

A camera that delivers nothing for `camera.max_age_ms` is reported as stale on
systemd's STATUS=, in the API's status and as a "camera" event (the nav thread
checks it every 0.2 s), not left to show only as stopped steps.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future  # 3.10: not the builtin TimeoutError
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.decoding.decoder import EdgeDecoder
from agent.decoding.link import tls_context
from agent.robot.camera import Frame, FrameGrabber
from agent.robot.control import ControlLoop
from agent.robot.controllers.base import Controller, ControllerError, make_controller
from agent.robot.episode import verdict
from agent.robot.safety import SafetyLayer
from protocol.images import MAX_IMAGE_BYTES, check_bytes

from .config import Config
from .drafting import DraftService, decoder_settings
from .navigator import Navigator, Step
from .overlap import Overlapped, mark_decision
from .recording import Recorder, sample_of
from .sdnotify import Notifier
from .senses import CameraWatch, make_perception, open_camera, open_recorder
from .telemetry import DiskTrouble, TelemetryWriter

if TYPE_CHECKING:
    from agent.client import Client
    from agent.decoding.drafter import Drafter  # llama-cpp: imported when the daemon loads one

log = logging.getLogger(__name__)

MAX_PENDING = 4  # submitted tasks waiting behind the running one
MAX_LISTENERS = 32
REFUSED_PAUSE_S = 0.05  # the nav thread's pause after a refused step (no fresh frame, holding)
MAX_RECORDS = 1000  # a task's step records kept for its summary (the later ones are dropped)
RESET_TIMEOUT_S = 30.0  # a reset waits this long for the robot to stand up (RecoveryStand, BalanceStand)
MAX_IMAGE_B64 = 4 * -(-MAX_IMAGE_BYTES // 3)  # base64 characters of the largest image submit takes


class Busy(RuntimeError):
    pass


class Daemon:
    def __init__(
        self,
        cfg: Config,
        *,
        drafter: Drafter | None = None,
        controller: Controller | None = None,
        notifier: Notifier | None = None,
        max_steps: int = 40,
        on_step: Callable[[int, Step], None] | None = None,
    ):
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.max_steps = max_steps
        self.task_timeout_s = cfg.agent.task_timeout_s  # the most a task spends held (no plan made)
        self.on_step = on_step  # (n, record) after each step: `edge-agent run`'s transcript
        self._drafter = drafter
        self.controller = controller or make_controller(cfg.robot.controller, **cfg.robot.options)
        self.world = getattr(self.controller, "world", None)  # the simulator, when the robot is one
        self.safety = SafetyLayer(self.controller, cfg.safety, ranges=self.controller.ranges)
        self.grabber: FrameGrabber | None = None
        self.control: ControlLoop | None = None
        self.decoder: EdgeDecoder | None = None
        self.drafts: DraftService | None = None  # the draft model, its turns (navigation first), the chat's client
        self.nav: Navigator | None = None
        self.runner: Overlapped | None = None  # agent.overlap: the steps decided during the previous motion
        self._disk = DiskTrouble()  # the telemetry's and the recording's: a full disk is one warning
        self.telemetry = TelemetryWriter(telemetry_path(cfg.telemetry.path), cfg.telemetry.max_bytes, self._disk)
        self.recorder: Recorder | None = None  # record.path / record.foxglove: made by start()
        self._tasks: queue.Queue = queue.Queue(MAX_PENDING)
        self._ids = itertools.count(1)
        self._cancel = threading.Event()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._listeners: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        self._decoding = threading.Lock()  # one submitted image decoded at a time; another is refused (Busy)
        self.model_lock: object = None  # the draft model's turns (DraftService.turns), made by start()
        self.task: dict | None = None  # the running task's status
        self.last_step: dict | None = None
        self.task_records: list = []  # the running (or last) task's nav.Step records, the first MAX_RECORDS
        self.history: list[dict] = []  # finished tasks, the last 16
        # the camera ok, stale or starting (camera_state, check_camera): agent/app/senses.py
        self.camera_watch = CameraWatch(cfg, self._emit, lambda: self.notifier.status(self._status_line()))
        self.started = time.monotonic()
        self.ready = False

    # -------------------------------------------------------------- lifecycle

    def start(self, notify_ready: bool = True) -> "Daemon":
        cfg = self.cfg
        log.info("config in use: %s", cfg.to_dict())
        # a missing package or a refused address: before anything moves
        self.recorder = open_recorder(cfg.record, self._disk)
        token = os.environ.get(cfg.link.token_env, "") if cfg.link.token_env else ""
        if cfg.link.verifier:  # a token in clear or a bad CA file: refused before anything moves
            tls_context(cfg.link.verifier, token, cfg.link.ca_file, cfg.link.allow_insecure)
        self.controller.connect()
        self.grabber = grabber = open_camera(cfg, self.world)
        self.camera_watch.started()
        self.control = ControlLoop(
            self.safety,
            cfg.robot.control_hz,
            frame_age=grabber.latest_age_s,
            watchdog=self.notifier.watchdog,
            watchdog_interval_s=self.notifier.watchdog_interval_s(),
        ).start()
        self.notifier.status("loading the draft model")
        self.drafts = DraftService.open(cfg, token, self._drafter)
        self.decoder, self._drafter, self.model_lock = self.drafts.decoder, self.drafts.drafter, self.drafts.turns
        log.info("draft offload (llama.cpp's own query): %s", getattr(self._drafter, "offload", "unknown"))
        self.nav = Navigator(
            self.decoder,
            grabber,
            make_perception(cfg, self.world),
            self.control,
            cfg,
            emit=self._emit,
            on_mode=self._on_mode,
            turns=self.drafts.navigation,
        )
        self.runner = Overlapped(self.nav) if cfg.agent.overlap else None
        self.nav.check_link()
        self.notifier.status("prefilling the prompt")
        self.nav.warm_up()
        self._worker = threading.Thread(target=self._run_tasks, name="nav", daemon=True)
        self._worker.start()
        self.ready = True
        if notify_ready:  # else the caller does, once its API listens too
            self.notifier.ready()
        self.notifier.status(self._status_line())
        log.info(
            "ready: controller %s, camera %s, perception %s, verifier %s (%s), offline policy %s",
            self.controller.name,
            cfg.camera.source,
            cfg.perception.kind,
            cfg.link.verifier or "none",
            self.nav.link,
            cfg.offline.policy,
        )
        return self

    def record_step(self, rec: Step) -> None:
        """One step to the recording (record.path, record.foxglove), when there is one; never raises."""
        if self.recorder is None:
            return
        frame, sightings = (self.nav.look_of(rec.step) if self.nav else None) or (None, [])
        try:
            sample = sample_of(
                rec, frame, sightings, self.world, self.safety, self.cfg.record.jpeg_quality, self.controller.odometry()
            )
        except Exception:  # a frame cv2 cannot encode: the step goes unrecorded, the robot goes on
            log.exception("recording step %s failed", getattr(rec, "step", "?"))
            return
        self.recorder.record(sample)

    def close(self) -> None:
        self.notifier.stopping()
        self._stop.set()
        self._cancel.set()
        if self.control is not None:
            self.control.halt("shutdown")
        if self._worker is not None:
            self._worker.join(10.0)
        if self.control is not None:
            self.control.stop()
        if self.grabber is not None:
            self.grabber.stop()
        self.safety.close()  # the last StopMove goes out (bounded) before the driver closes
        if self.drafts is not None:
            self.drafts.close()
        try:
            self.controller.disconnect()
        finally:
            self.telemetry.close()  # neither raises: a full disk must not cost the run its summary
            if self.recorder is not None:
                self.recorder.close()
        log.info("stopped")

    # -------------------------------------------------------------- the API's verbs

    def check_instruction(self, instruction: str) -> None:
        """ValueError unless the instruction is a non-empty string of at most 500 characters and, in the
        simulator with perception "sim", names one of the scene's objects (the error lists them)."""
        if not isinstance(instruction, str) or not instruction.strip() or len(instruction) > 500:
            raise ValueError("instruction must be a non-empty string of at most 500 characters")
        if self.world is None or self.cfg.perception.kind != "sim":
            return
        from .episode import target_object

        if target_object(self.world, instruction) is None:
            names = ", ".join(o.name for o in self.world.objects)
            raise ValueError(
                f"the instruction {instruction.strip()!r} names no object in the scene "
                f"{self.world.scene!r}; its objects: {names}"
            )

    def submit(self, instruction: str, image: str | None = None, max_steps: int | None = None) -> int:
        """Queue an instruction (with an optional base64 JPEG/PNG); returns its task id. Busy when full, checked
        before the image is decoded (untrusted bytes: bounded first, then decoded one at a time)."""
        if not isinstance(instruction, str) or not instruction.strip() or len(instruction) > 500:
            raise ValueError("instruction must be a non-empty string of at most 500 characters")
        steps = self.max_steps if max_steps is None else max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
            raise ValueError(f"max_steps must be an integer 1..1000, got {str(steps)[:20]}")
        if image is not None and not isinstance(image, str):
            raise ValueError("image must be a base64 string (or a data: URI) of a JPEG or PNG")
        if image and self.cfg.perception.kind == "sim":
            raise ValueError(
                "an image needs perception 'color' or 'vlm' (perception 'sim' reads the simulator, not pixels)"
            )
        self.check_instruction(instruction)  # in the simulator: it names one of the scene's objects
        if self._tasks.full():
            raise Busy(f"{MAX_PENDING} tasks already wait; cancel first")
        frame = None
        if image:
            if not self._decoding.acquire(blocking=False):
                raise Busy("another submitted image is being decoded; try again")
            try:
                frame = _decode_image(image)
            finally:
                self._decoding.release()
        task_id = next(self._ids)
        task = {"id": task_id, "instruction": instruction.strip(), "frame": frame, "max_steps": steps}
        try:
            self._tasks.put_nowait(task)
        except queue.Full:
            raise Busy(f"{MAX_PENDING} tasks already wait; cancel first") from None
        return task_id

    def cancel(self) -> int:
        """Stop the running task (and drop the waiting ones); the robot halts. Returns how many were dropped."""
        dropped = 0
        while True:
            try:
                self._tasks.get_nowait()
                dropped += 1
            except queue.Empty:
                break
        self._cancel.set()
        if self.control is not None:
            self.control.halt("cancelled")
        return dropped

    def estop(self, by: str = "") -> Future:
        """Never through a model and never waiting: latched when this returns; the future is the driver's
        e-stop (Damp), which runs on a thread of its own (the API's event loop calls this). `by`: who asked
        (the API's peer), for the log."""
        delivery = self.control.estop() if self.control is not None else self.safety.estop()
        self.cancel()
        self._emit({"event": "estop"})
        log.warning("E-STOP from %s", by or "this process")
        return delivery

    def reset(self, timeout_s: float = RESET_TIMEOUT_S, by: str = "") -> None:
        """Release the e-stop once the robot is ready (a Go2 stood up again); waits, so never on the event loop.
        Raises ControllerError when the driver failed, timed out or a new e-stop came meanwhile."""
        log.warning("reset (releases the e-stop) from %s", by or "this process")
        try:
            self.safety.reset().result(timeout_s)
        except FutureTimeout:
            raise ControllerError(
                f"the robot was not ready within {timeout_s:.0f} s; the e-stop stays latched"
            ) from None
        self._emit({"event": "reset"})

    def status(self) -> dict:
        nav = self.nav
        age = self.grabber.latest_age_s() if self.grabber else None
        grabber = self.grabber
        return {
            "ready": self.ready,
            "mode": "verified" if nav and nav.link == "up" else "offline",
            "link": nav.link if nav else "unknown",
            "offline_policy": self.cfg.offline.policy,
            "estopped": self.safety.estopped,
            "controller": self.controller.name,
            "driver_calls": self.safety.driver_calls(),
            "draft_offload": getattr(self._drafter, "offload", None),
            "camera": {
                "source": self.cfg.camera.source,
                "state": self.camera_state,
                "frames": grabber.frames if grabber else 0,
                "error": grabber.error if grabber else None,
            },
            "camera_age_ms": None if age is None else round(age * 1e3, 1),
            "perception": self.cfg.perception.kind,
            "task": self.task,
            "last_step": self.last_step,
            "pending": self._tasks.qsize(),
            "steps": nav.steps if nav else 0,
            "offline_steps": nav.offline_steps if nav else 0,
            "offline_clamped": nav.offline_clamped if nav else 0,
            "offline_turn_away_stops": nav.offline_turn_away_stops if nav else 0,
            "safety_stops": dict(self.safety.stops),
            "overlap": {  # agent.overlap: plans decided during a motion and refused when it ended; chat's yields
                "on": self.runner is not None,
                "refused_stale": self.runner.refused_stale if self.runner else 0,
                "refused_cut_short": self.runner.refused_cut if self.runner else 0,
                "chat_yields": self.drafts.turns.chat_yields if self.drafts else 0,
            },
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    def listen(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Add an event listener (the API's subscribers); returns the function that removes it."""
        with self._lock:
            if len(self._listeners) >= MAX_LISTENERS:
                raise Busy(f"at most {MAX_LISTENERS} subscribers")
            self._listeners.append(fn)
        return lambda: self._unlisten(fn)

    def _unlisten(self, fn: Callable[[dict], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    # -------------------------------------------------------------- the nav thread

    def _run_tasks(self) -> None:
        while not self._stop.is_set():
            self.check_camera()
            try:
                task = self._tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            self._cancel.clear()
            self._run_task(task)

    def _run_task(self, task: dict) -> None:
        assert self.nav is not None and self.control is not None, "start() first"
        self.task = {"id": task["id"], "instruction": task["instruction"], "step": 0, "state": "running"}
        self._emit({"event": "task", "task": task["id"], "instruction": task["instruction"], "state": "running"})
        frame, moving_steps, held_s = task["frame"], 0, 0.0
        self.task_records = []
        state, misses = "max_steps", 0
        while moving_steps < task["max_steps"]:
            if self.safety.estopped:
                state = "estopped"
                break
            if self._cancel.is_set() or self._stop.is_set():
                state = "cancelled"
                break
            if held_s > self.task_timeout_s:  # held steps make no plan: this, not max_steps, bounds them
                state = "timeout"
                break
            t_step = time.monotonic()
            try:  # the navigator takes the draft model's turn for its generation (DraftService: ahead of chat)
                if self.runner is not None:
                    last = moving_steps + 1 >= task["max_steps"]
                    rec = self.runner.step(task["instruction"], str(task["id"]), self._cancel, frame, last=last)
                else:
                    rec = self.nav.step(task["instruction"], task=str(task["id"]), cancel=self._cancel, frame=frame)
            except Exception:  # never let one bad step kill the nav thread: stop, end the task
                log.exception("step failed; stopping the robot and ending the task")
                state = "error"
                break
            frame = None  # an image from the API is used for the first step only
            if len(self.task_records) < MAX_RECORDS:  # refused steps count toward task_timeout_s, not max_steps
                self.task_records.append(rec)
            if self.on_step is not None:
                try:
                    self.on_step(len(self.task_records), rec)
                except Exception:  # a printer that fails (a closed pipe) must not end the task
                    log.exception("the step hook failed")
            self.check_camera()
            mark_decision(self.world, rec)
            record = {**rec.to_json(), "safety_stops": dict(self.safety.stops), "clearance_m": self.safety.clearance_m}
            self.telemetry.write(record)
            self.record_step(rec)
            self.last_step = {
                k: record[k] for k in ("step", "mode", "action", "parse", "reason", "command", "latency_ms")
            }
            self.task["step"] = rec.step
            self.notifier.status(self._status_line())
            if rec.parse == "refused":  # holding or no frame: not a step of the plan
                self._stop.wait(REFUSED_PAUSE_S)  # a camera with no frame yet must not make this a busy loop
                held_s += time.monotonic() - t_step
                continue
            moving_steps += 1
            end, misses = verdict(rec, misses)  # the episode loop's own end rule: done, or too many misses
            if end:
                state = end
                break
        if self.safety.estopped:
            state = "estopped"
        if self.runner is not None:
            self.runner.drop()
        self.control.halt("task_end")
        self.task["state"] = state
        self._emit({"event": "task", "task": task["id"], "state": state})
        self.history = (self.history + [dict(self.task)])[-16:]
        held = len(self.task_records) - moving_steps
        log.info(
            "task %s (%s): %s after %d steps (%d moving, %d held for %.0f s)",
            task["id"],
            task["instruction"],
            state,
            len(self.task_records),
            moving_steps,
            held,
            held_s,
        )

    # -------------------------------------------------------------- events

    def _emit(self, event: dict) -> None:
        event = {"t": round(time.time(), 3), **event}
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(event)
            except Exception:
                log.exception("event listener failed")

    @property
    def camera_state(self) -> str:
        """ok | stale (nothing new for camera.max_age_ms) | starting."""
        return self.camera_watch.state

    def check_camera(self) -> str:
        """Report a camera that went quiet (or came back) on STATUS=, the log and the events; returns its state."""
        return self.camera_watch.check(self.grabber)

    def _on_mode(self, mode: str) -> None:
        if self.world is not None:
            self.world.tag = mode  # the sim's map colours the path by mode
        self.notifier.status(self._status_line())

    def _status_line(self) -> str:
        mode = "verified" if self.nav and self.nav.link == "up" else f"offline ({self.cfg.offline.policy})"
        task = (
            f"task {self.task['id']} step {self.task['step']}"
            if self.task and self.task["state"] == "running"
            else "idle"
        )
        camera = f", camera {self.cfg.camera.source} stale" if self.camera_state == "stale" else ""
        estop = ", E-STOP latched" if self.safety.estopped else ""
        return f"{mode}, {task}{camera}{estop}"


def state_directory() -> Path:
    """Where the daemon keeps its state: $STATE_DIRECTORY (systemd's StateDirectory=; the first of a list),
    else $XDG_STATE_HOME/edge-agent, else ~/.local/state/edge-agent."""
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd)
    xdg = os.environ.get("XDG_STATE_HOME", "")
    return Path(xdg if os.path.isabs(xdg) else Path.home() / ".local" / "state") / "edge-agent"


def telemetry_path(path: str) -> Path | None:
    """telemetry.path: "" none, an absolute path itself, a relative one under the state directory."""
    if not path:
        return None
    return Path(path) if os.path.isabs(path) else state_directory() / path


def chat_client(daemon: Daemon) -> Client:
    """The OpenAI endpoint's Client (api.openai_listen): the daemon's draft model (DraftService), its own link to
    the same verifier, and the model's turns: a navigation step goes first, a chat answer yields at its next round."""
    if daemon.drafts is None:
        raise RuntimeError("start() the daemon before its chat endpoint")
    return daemon.drafts.chat_client()


__all__ = ["Busy", "Daemon", "chat_client", "decoder_settings", "state_directory", "telemetry_path"]


def _decode_image(data: str) -> Frame:
    """A submitted image, bounded before any decoder runs: its base64 length, then its bytes and the width and
    height in its header (protocol.images.check_bytes); ValueError (ImageError is one) says what is wrong."""
    import cv2
    import numpy as np

    b64 = data.split(",", 1)[-1]  # a bare base64 or a data: URI
    if len(b64) > MAX_IMAGE_B64:
        raise ValueError(f"image over {MAX_IMAGE_BYTES} bytes ({len(b64)} base64 characters); send it smaller")
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError:
        raise ValueError("image must be base64 (or a data: URI) of a JPEG or PNG") from None
    check_bytes(raw)
    try:
        img = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
    except cv2.error:
        img = None
    if img is None:
        raise ValueError("image could not be decoded (JPEG or PNG expected)")
    return Frame(img, time.monotonic(), 0, {"source": "api"})
