"""llama.cpp's own output: quiet by default, all of it with --verbose or EDGESPEC_VERBOSE=1.

llama.cpp writes two ways. Its log (model loads, context warnings, the quantizer's line per
tensor) goes through the callback llama-cpp-python installs (`llama_cpp._logger`), which prints
to Python's sys.stderr at the level `set_verbose` sets. Some of its code and ggml's print from C
to the process's file descriptors 1 and 2, which no callback sees: `c_output_to` points those
descriptors at a log file around a call, so a long C operation (the quantizer) stays off the
terminal while its log is kept for when it fails.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ENV = "EDGESPEC_VERBOSE"


def verbose() -> bool:
    """Whether third-party logs are wanted: EDGESPEC_VERBOSE set to anything but "" or "0"."""
    return os.environ.get(ENV, "") not in ("", "0")


def want_verbose(flag: bool) -> bool:
    """A command's --verbose: sets EDGESPEC_VERBOSE for this process and those it starts; the result."""
    if flag:
        os.environ[ENV] = "1"
    return verbose()


def set_verbose(on: bool | None = None) -> None:
    """llama.cpp's log callback: every line when on, its errors only otherwise (None: `verbose()`)."""
    import llama_cpp._logger

    llama_cpp._logger.set_verbose(verbose() if on is None else on)


@contextlib.contextmanager
def c_output_to(log_path: str | Path) -> Iterator[Path]:
    """Within: file descriptors 1 and 2 (C's stdout and stderr, and Python's, which write to them)
    go to log_path (truncated), and llama.cpp's log callback passes every line, so the file holds the
    whole log. Both are restored after, also on an exception."""
    import llama_cpp._logger

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger = llama_cpp._logger.logger
    level = logger.level
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            llama_cpp._logger.set_verbose(True)
            try:
                yield log_path
            finally:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                logger.setLevel(level)
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)


def tail(log_path: str | Path, n: int = 20) -> str:
    """The last n lines of a log file ("" when there is none)."""
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
