"""JSONSchemaBench's full data, fetched from a pinned archive and checked by content before any of it is read.

The benchmark's repository (github.com/guidance-ai/jsonschemabench) is not a Python package and is never on a model
hub: the data comes from GitHub's archive of one commit, JSB_COMMIT. Only its `data/` (9,558 schemas of ten
categories) and `maskbench/data/` (11,306 MaskBench schemas with valid and invalid instances) are extracted, as
plain files under the cache; the rest of the archive is skipped. The extracted tree must hash to JSB_DIGEST (a
SHA-256 over every file's path and SHA-256, in path order), so a moved tag, a changed archive or a truncated
download is refused rather than measured.

    path = jsb_data.ensure()          # ~/.cache/edgespec/jsonschemabench-ba103c737561: fetched once
    python -m tools.bench.schemas --data auto --out bench_results/schemas
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath
from typing import BinaryIO

JSB_COMMIT = "ba103c73756198dd9b149ddc7db7867da7a077f6"
ARCHIVE_URL = f"https://codeload.github.com/guidance-ai/jsonschemabench/tar.gz/{JSB_COMMIT}"
JSB_DIGEST = "8ee40069e885e384b9c40a06dd00d79152044475ff993e6edddf82db36c35a04"  # from the commit's tree (tree_digest)
KEPT = ("data/", "maskbench/data/")  # the parts of the repository the benchmark reads
MAX_ARCHIVE_BYTES = 512 << 20  # the whole repository at JSB_COMMIT, compressed
MAX_FILE_BYTES = 64 << 20  # cloudformation.schema.json, the largest, is the one over 2 MB
MAX_FILES = 25_000  # 20,864 files under KEPT (9,558 + 11,306)


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "edgespec" / f"jsonschemabench-{JSB_COMMIT[:12]}"


def git_blob(data: bytes) -> str:
    """The file's git object id (SHA-1 of `blob <size>\\0` and the bytes): what the commit's tree lists."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def tree_digest(root: Path) -> str:
    """SHA-256 over the files under KEPT, in path order: each one's path relative to `root`, a NUL, its git
    object id, a newline. The same text comes from the commit's own tree (`git ls-tree -r JSB_COMMIT data
    maskbench/data`), which is how JSB_DIGEST was made."""
    h = hashlib.sha256()
    files = sorted(
        (p.relative_to(root).as_posix(), p) for part in KEPT for p in (root / part).rglob("*") if p.is_file()
    )
    for name, path in files:
        h.update(f"{name}\0{git_blob(path.read_bytes())}\n".encode())
    return h.hexdigest()


def _kept_name(name: str) -> str | None:
    """The archive member's path inside the repository when it is under KEPT and safe, else None. GitHub's
    archives put everything under one top folder (`jsonschemabench-<commit>/`), which is dropped."""
    parts = PurePosixPath(name).parts
    if len(parts) < 2 or any(p in ("..", "") or p.startswith("/") for p in parts):
        return None
    inner = "/".join(parts[1:])
    return inner if inner.startswith(KEPT) else None


def extract(archive: BinaryIO, dest: Path) -> int:
    """The regular files under KEPT from a .tar.gz stream into `dest`, each bounded; links and devices skipped.
    Returns how many files were written."""
    n = 0
    with tarfile.open(fileobj=archive, mode="r|gz") as tar:
        for member in tar:
            inner = _kept_name(member.name)
            if inner is None or not member.isfile():
                continue
            if member.size > MAX_FILE_BYTES or n >= MAX_FILES:
                raise ValueError(f"{inner}: {member.size} bytes, or more than {MAX_FILES} files: not JSB's data")
            src = tar.extractfile(member)
            if src is None:
                continue
            out = dest / inner
            out.parent.mkdir(parents=True, exist_ok=True)
            with src, open(out, "wb") as f:
                shutil.copyfileobj(src, f)
            n += 1
    return n


def _download(url: str, to: BinaryIO) -> None:
    with urllib.request.urlopen(url, timeout=60) as r:  # noqa: S310  a fixed https URL
        got = 0
        while chunk := r.read(1 << 20):
            got += len(chunk)
            if got > MAX_ARCHIVE_BYTES:
                raise ValueError(f"{url}: more than {MAX_ARCHIVE_BYTES >> 20} MiB: not the pinned archive")
            to.write(chunk)
            print(f"\r  JSONSchemaBench: {got >> 20} MiB", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def ensure(url: str = ARCHIVE_URL, expected: str = JSB_DIGEST) -> Path:
    """The checked data folder: the cache when it is there and hashes right, else fetched, extracted, checked and
    moved into place (a failed or partial fetch leaves nothing behind)."""
    final = cache_dir()
    if final.is_dir() and (final / ".digest").is_file() and (final / ".digest").read_text() == expected:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        work = Path(tmp) / "tree"
        with tempfile.TemporaryFile() as archive:
            print(f"fetching {url}", file=sys.stderr)
            _download(url, archive)
            archive.seek(0)
            n = extract(archive, work)
        got = tree_digest(work)
        if got != expected:
            raise ValueError(f"JSONSchemaBench at {JSB_COMMIT[:12]}: {n} files hash to {got}, not {expected}")
        (work / ".digest").write_text(got)
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
    return final
