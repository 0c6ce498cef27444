"""Telemetry: one JSON line per navigation step, in a size-bounded file.

When the file passes `max_bytes` it is renamed to `<path>.1` (replacing the
previous one) and a new file starts, so the disk holds at most about twice
`max_bytes`. Thread-safe. A write error (a full or read-only disk) stops the telemetry and never stops
the robot: neither write() nor close() raises. The run's outputs share one DiskTrouble, so a disk that
fills under the telemetry and the recording says so in one warning (the second output's stop at INFO).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)


class DiskTrouble:
    """Says once that the disk failed the run's outputs: the first stop a warning, a later one for the same
    error (the same full or read-only disk under another file) an INFO line. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[int | None] = set()  # the errnos warned about

    def stopped(self, what: str, path: object, error: OSError) -> None:
        """`what` (telemetry, recording) to `path` stopped on `error`; the robot goes on."""
        with self._lock:
            first = error.errno not in self._said
            self._said.add(error.errno)
        why = error.strerror or str(error)
        if first:
            log.warning("%s to %s stopped: %s; the robot goes on without it", what, path, why)
        else:
            log.info("%s to %s stopped too: %s", what, path, why)


class TelemetryWriter:
    def __init__(
        self, path: str | os.PathLike[str] | None, max_bytes: int = 50_000_000, disk: DiskTrouble | None = None
    ) -> None:
        if max_bytes < 1024:
            raise ValueError(f"telemetry max_bytes must be at least 1024, got {max_bytes}")
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        self.records = 0
        self.rotations = 0
        self._failed = False
        self._disk = disk or DiskTrouble()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None or self._failed:
            return
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            try:
                if self._fh is None:
                    self._fh = open(self.path, "a", encoding="utf-8")
                if self._fh.tell() + len(line) > self.max_bytes and self._fh.tell() > 0:
                    self._fh.close()
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    self.rotations += 1
                    self._fh = open(self.path, "a", encoding="utf-8")
                self._fh.write(line)
                self._fh.flush()
                self.records += 1
            except OSError as e:
                self._disk.stopped("telemetry", self.path, e)
                self._failed = True
                self._drop()

    def _drop(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()  # a failed flush raises again, and the descriptor is closed all the same
            self._fh = None

    def close(self) -> None:
        with self._lock:
            if self._fh is None:
                return
            try:
                self._fh.close()
            except OSError as e:
                if not self._failed:
                    self._disk.stopped("telemetry", self.path, e)
                self._failed = True
            self._fh = None
