"""One grammar-compile worker process: a peer's grammar or schema compiled where a crash costs only that request.

Started by protocol/sandbox.py as `python -m protocol.compile_worker GGUF N_VOCAB STACK_BYTES MEMORY_BYTES`. It
loads the GGUF's vocabulary alone (no weights), builds LLGuidance's tokenizer over it exactly as the serving
process does (structured.tokenizer_of), caps its own address space at what it holds then plus MEMORY_BYTES, and
answers one request at a time on its pipes: a frame in ({"kind", "text"}), a frame out ({"ok": true}, or the
typed refusal {"error", "message", "keyword", "where"}). Each compile runs in a thread of STACK_BYTES of stack,
a quarter of what the serving process gives its own compile (structured.COMPILE_STACK_BYTES): LLGuidance is
deterministic, so what compiled and took its first mask here does so there with room to spare.

A frame is a 4-byte big-endian length and a msgpack map. stdout carries frames alone: file descriptor 1 is
pointed at stderr once the frame channel has its own copy, so nothing native can write into it.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from typing import Any

from protocol.sandbox import MAX_REQUEST_BYTES, frame, read_frame


def _answer(tokenizer: Any, kind: str, text: str, stack_bytes: int) -> dict[str, Any]:
    """The compile of one request in a thread of `stack_bytes` of stack: {"ok": True} or the refusal."""
    from protocol.grammar import GrammarError, SchemaError
    from protocol.structured import build_matcher

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            build_matcher(tokenizer, kind, text)
            out["ok"] = True
        except SchemaError as e:
            out.update(error="SchemaError", message=str(e), keyword=e.keyword, where=e.where)
        except GrammarError as e:
            out.update(error="GrammarError", message=str(e))

    threading.stack_size(stack_bytes)
    worker = threading.Thread(target=run, name="grammar-compile")
    worker.start()
    worker.join()
    return out or {"error": "GrammarError", "message": "the grammar's compile ended without an answer"}


def main(argv: list[str]) -> int:
    gguf, n_vocab, stack_bytes, memory_bytes = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray native output goes to stderr, never into the frames
    requests = os.fdopen(os.dup(0), "rb")
    from protocol.grammar import vocab_only
    from protocol.structured import tokenizer_of

    _, vocab, _ = vocab_only(gguf)
    tokenizer = tokenizer_of(vocab, n_vocab)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash ends at once, with no core to write first
    held = _address_space()
    if held and memory_bytes > 0:  # what a compile may add to what the worker holds now
        resource.setrlimit(resource.RLIMIT_AS, (held + memory_bytes, held + memory_bytes))
    channel.write(frame({"ready": True, "pid": os.getpid()}))
    while True:
        req = read_frame(requests, MAX_REQUEST_BYTES)
        if req is None:
            return 0
        channel.write(frame(_answer(tokenizer, str(req.get("kind")), str(req.get("text")), stack_bytes)))


def _address_space() -> int:
    """This process's virtual size in bytes (/proc/self/status VmSize); 0 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
