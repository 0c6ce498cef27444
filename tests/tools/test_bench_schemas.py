"""tools/bench/schemas.py's parts: JSONSchemaBench's data fetched from the pinned archive (only the data folders,
only plain files, checked by content; here over file:// archives built like GitHub's, one folder on top), and the
endpoint sample's draw and judgement."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tools.bench import jsb_data


def archive(tmp_path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    path = tmp_path / "jsb.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


FILES = {
    "jsb-x/data/Glaiveai2K/a.json": json.dumps({"type": "object"}).encode(),
    "jsb-x/maskbench/data/Glaiveai2K---a.json": json.dumps({"schema": {}, "tests": []}).encode(),
}


def test_only_the_data_folders_are_extracted_as_plain_files(tmp_path):
    hostile = {
        **FILES,
        "jsb-x/README.md": b"not data",
        "jsb-x/data/../../escape.json": b"{}",
        "/abs/data/x.json": b"{}",
    }
    src = archive(tmp_path, hostile, links={"jsb-x/data/link.json": "/etc/passwd"})
    dest = tmp_path / "out"
    with open(src, "rb") as f:
        assert jsb_data.extract(f, dest) == 2
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert got == ["data/Glaiveai2K/a.json", "maskbench/data/Glaiveai2K---a.json"]
    assert not (tmp_path / "escape.json").exists()


def test_the_digest_is_the_commits_tree_listing(tmp_path):
    """tree_digest over files equals the digest of `git ls-tree`'s (path, object id) lines: how JSB_DIGEST is
    pinned without the files (b'hello\\n' is git's well-known ce0136...)."""
    (tmp_path / "data" / "c").mkdir(parents=True)
    (tmp_path / "data" / "c" / "s.json").write_bytes(b"hello\n")
    assert jsb_data.git_blob(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
    import hashlib

    listed = hashlib.sha256(b"data/c/s.json\0ce013625030ba8dba906f756967f9e9ca394464a\n").hexdigest()
    assert jsb_data.tree_digest(tmp_path) == listed


def test_ensure_fetches_once_and_refuses_other_content(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = archive(tmp_path, FILES)
    staged = tmp_path / "staged"
    with open(src, "rb") as f:
        jsb_data.extract(f, staged)
    digest = jsb_data.tree_digest(staged)

    with pytest.raises(ValueError, match="hash to"):
        jsb_data.ensure(src.as_uri(), expected="0" * 64)
    assert not jsb_data.cache_dir().exists()  # a refused fetch leaves nothing behind

    got = jsb_data.ensure(src.as_uri(), expected=digest)
    assert (got / "data" / "Glaiveai2K" / "a.json").read_bytes() == FILES["jsb-x/data/Glaiveai2K/a.json"]
    src.unlink()  # the second call reads the cache, never the archive
    assert jsb_data.ensure(src.as_uri(), expected=digest) == got


def answer(finish: str, content: str) -> dict:
    return {"choices": [{"finish_reason": finish, "message": {"content": content}}]}


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, answer("stop", '{"n": 3}'), "valid"),
        (200, answer("stop", '{"n": "three"}'), "invalid"),  # JSON, but not the schema's
        (200, answer("stop", '{"n": 3'), "invalid"),  # called complete, not JSON
        (200, answer("length", '{"n": 3'), "truncated"),
        (400, {"error": {"message": "response_format: not is not supported"}}, "refused"),
        (500, {"error": {"message": "boom"}}, "broken"),
    ],
)
def test_each_endpoint_answer_is_judged(status, body, outcome):
    pytest.importorskip("jsonschema")
    from tools.bench import schemas_endpoint

    assert schemas_endpoint._judge(status, body, SCHEMA)[0] == outcome


def test_the_endpoint_sample_draws_n_of_each_named_category():
    from tools.bench import schemas

    rows = [(c, f"{c}{i}", {}, []) for c in ("A", "B", "C") for i in range(5)]
    picked = schemas.endpoint_sample(rows, ["A", "C"], 2, seed=1)
    assert [c for c, _, _ in picked] == ["A", "A", "C", "C"]
    assert picked == schemas.endpoint_sample(rows, ["A", "C"], 2, seed=1)  # seeded: the same draw


def test_the_caps_benchmark_measures_each_family_and_counts_refusals(tmp_path):
    """A quick run: each family within its cap compiles and walks its valid instance; the sample's schemas are
    counted against every cap."""
    import json

    from tools.bench import schema_caps

    assert schema_caps.main(["--quick", "--caps", "optional,repeat", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "schema_caps.json").read_text())
    rows = result.get("result", result)
    within = [r for r in rows["families"] if r["within_caps"]]
    assert {r["cap"] for r in within} == {"optional", "repeat"}
    assert all(r["compiled"] and "instance" not in r for r in within), within
    assert {r["constant"] for r in rows["jsb"]} == set(schema_caps.CAPS)
    assert all(r["of"] == 112 for r in rows["jsb"])
    assert (tmp_path / "schema_caps.md").exists() and (tmp_path / "schema_caps.png").exists()
