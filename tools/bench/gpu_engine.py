"""Both engines on a GPU against the HBM roofline, with a randomly initialised Llama of 7B shape.

Cost does not depend on the weights' values, so no weights are downloaded: the torch engine gets a
LlamaForCausalLM built from its config on the device (bf16 by default), the llamacpp engine the same
shape as an F16 GGUF with random weights (tools/models/random_target.py, every layer offloaded; `--gguf-dtype
q4_k_m`: that GGUF quantized to Q4_K_M by llama.cpp's quantizer, its file size the roofline's bytes). For each
(sessions per pass, new tokens per session) on caches of --cache tokens the pass time is set against
the roofline, weight bytes / measured bandwidth (a pass must read every weight once; the bandwidth is
timed with a large device-to-device copy). Beside them, llama.cpp's own `llama-batched-bench` on the
same GGUF (its token-generation step: one token per sequence, the `tokens = 1` column; built by
tools/build_llama_server.sh). Aims: a 1-session 5-token pass within 1.5x of the roofline, 32x5
within 2x (torch) and 3x (llamacpp).

`torch` is the torch engine's eager pass, `torch-compiled` the same engine with `torch_compile = "on"`
(server_bridge/engines/compile_torch.py: the pass padded to power-of-two buckets, inductor, CUDA graphs on
CUDA; what `serve --engine torch` runs on CUDA by default): each of its rows names the bucket its pass ran
in, and its run the seconds the compile took. It runs beside an eager engine on the same model, in one
process, the two engines' passes interleaved (that process gives the `torch` rows too).

Each engine runs in its own process (`--only ENGINE --result FILE`): a CUDA llama.cpp and a CUDA
torch never share one (runtime/native.py).

    python -m tools.bench.gpu_engine --out bench_results/gpu          # on a CUDA server
    python -m tools.bench.gpu_engine --tiny --device cpu --out /tmp/g  # the same code on a toy model
    python -m tools.bench.gpu_engine --tiny --device cpu --dtype float32 --engines torch,torch-compiled \
        --out docs/benchmarks/torch_compile_cpu/tiny  # compiled against eager, on the CPU
    python -m tools.bench.gpu_engine --shape smollm2-135m ...   # another random_target shape

Writes gpu_engine.json, gpu_engine.md and gpu_engine.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.models import random_target

ENGINES = ("torch", "torch-compiled", "llamacpp")


def _shape(args) -> random_target.Shape:
    """--shape (a random_target shape's name), else the 7B shape, or the toy one with --tiny."""
    if args.shape:
        return random_target.SHAPES[args.shape]
    return random_target.TINY if args.tiny else random_target.LLAMA_7B


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_gbs(device: str, mib: int) -> float:
    """Device memory bandwidth from a large copy (read + write counted)."""
    import torch

    device = torch.device(device)
    src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def build_torch(shape: random_target.Shape, device: str, dtype: str, slots: int, max_len: int, compile: str = "off"):
    """A torch engine on a Llama of `shape` built from its config (random weights) on the device; compile: its
    torch_compile (off: the eager pass)."""
    import torch
    from transformers import LlamaForCausalLM

    from server_bridge.engines.torch import TorchEngine

    cfg = shape.llama_config()
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch_dtype)
    return TorchEngine(
        Path("random"),
        f"{shape.name}-shape",
        device=device,
        dtype=dtype,
        max_sequences=slots,
        max_len=max_len,
        model=model,
        compile=compile,
    )


def build_llamacpp(gguf: Path, device: str, slots: int, per_session: int, threads: int, llama_options: dict):
    """The llamacpp engine on the random GGUF, every layer offloaded on a GPU (none with --device cpu)."""
    from server_bridge.engines import load_engine

    return load_engine(
        str(gguf),
        "llamacpp",
        threads=threads,
        max_sequences=slots,
        kv_tokens=slots * per_session,
        n_gpu_layers=0 if device == "cpu" else -1,
        **llama_options,
    )


def pass_ms(engines: list, sync, seqs: list, cache: int, k: int, iters: int) -> list[float]:
    """Each engine's median pass (ms) over its sessions seqs[i] on caches of `cache` tokens, k new tokens each;
    the engines' passes interleaved, so a busy machine's noise falls on each alike."""
    from server_bridge.engines import Pass

    def run(engine, held):
        for s in held:
            engine.truncate(s, cache)
        engine.forward([Pass(s, cache, list(range(10, 10 + k)), k) for s in held])
        sync()

    times: list[list[float]] = [[] for _ in engines]
    for i in range(iters + 1):  # the first: untimed (a new bucket's CUDA graph is recorded there)
        for engine, held, t in zip(engines, seqs, times, strict=True):
            t0 = time.perf_counter()
            run(engine, held)
            if i:
                t.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(t) for t in times]


def load(args, engine_name: str, shape: random_target.Shape, slots: int, per_session: int) -> dict:
    """The engines one child times: {name: engine} (torch-compiled: beside an eager torch engine on the same
    model), the weights' bytes, a device sync, the dtype, and the compile's seconds and status."""
    out: dict = {"compiled": {}}
    if engine_name.startswith("torch"):
        mode = "on" if engine_name == "torch-compiled" else "off"
        engine = build_torch(shape, args.device, args.dtype, slots, per_session, mode)
        out["engines"] = {engine_name: engine}
        if engine.compiled is not None:
            t0 = time.perf_counter()
            engine.warm()
            out["compiled"] = {"compile_s": round(time.perf_counter() - t0, 1), "status": engine.compiled.status()}
            print(f"{engine_name}: compiled in {out['compiled']['compile_s']} s ({engine.compiled.status()})")
            from server_bridge.engines.torch import TorchEngine

            eager = TorchEngine(
                Path("random"), engine.name, device=args.device, dtype=args.dtype, max_sequences=slots,
                max_len=per_session, model=engine.model, compile="off",
            )  # fmt: skip
            out["engines"] = {"torch": eager, engine_name: engine}
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        out["sync"] = lambda: _sync(engine.device)
        out["dtype"] = args.dtype
    else:
        gguf = random_gguf(args, log=lambda m: print(m, flush=True))
        engine = build_llamacpp(gguf, args.device, slots, per_session, args.threads, _llama_options(args))
        quantized = args.gguf_dtype in ("q4_k_m", *random_target.QUANTIZED)  # the file's bytes are the weights'
        out["engines"] = {engine_name: engine}
        out["weight_bytes"] = gguf.stat().st_size if quantized else shape.weight_bytes(args.gguf_dtype)
        out["sync"] = lambda: None  # forward returns host rows: it waited
        out["dtype"] = engine.info.dtype
    return out


def measure(args, engine_name: str, bandwidth: float) -> dict:
    """One engine's grid, in this process (torch-compiled: the eager torch engine's too, interleaved)."""
    sessions, tokens = _ints(args.sessions), _ints(args.tokens)
    loaded = load(args, engine_name, _shape(args), max(sessions), args.cache + max(tokens) + 1)
    engines, weight_bytes, dtype = loaded["engines"], loaded["weight_bytes"], loaded["dtype"]
    engine = engines[engine_name]
    roofline_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    print(
        f"{engine_name}: {engine.name} on {engine.info.device} in {dtype}: {weight_bytes / 2**30:.2f} GiB of "
        f"weights, roofline {roofline_ms:.3f} ms per pass ({bandwidth:.0f} GB/s)",
        flush=True,
    )
    from server_bridge.engines import Pass

    seqs = {}
    for name, e in engines.items():
        seqs[name] = [e.new_sequence() for _ in range(max(sessions))]
        e.forward([Pass(s, 0, list(range(3, 3 + args.cache)), 0) for s in seqs[name]])  # warm caches
    rows = []
    for n in sessions:
        for k in tokens:
            held = [seqs[name][:n] for name in engines]
            times = pass_ms(list(engines.values()), loaded["sync"], held, args.cache, k, args.iters)
            for (name, e), ms in zip(engines.items(), times, strict=True):
                rows.append(
                    {
                        "engine": name,
                        "sessions": n,
                        "tokens": k,
                        "pass_ms": round(ms, 3),
                        "x_roofline": round(ms / roofline_ms, 2),
                        **_bucket(e, seqs[name][:n], args.cache, k),
                    }
                )
                print(f"  {name} {n:2d} sessions x {k} tokens: {ms:.3f} ms ({ms / roofline_ms:.2f}x roofline)")
    compiled = loaded["compiled"]
    return {
        "engine": engine_name,
        "model": engine.name,
        "dtype": dtype,
        "weight_bytes": weight_bytes,
        "roofline_ms": round(roofline_ms, 4),
        "info": engine.info.as_dict(),
        "rows": rows,
        **({"compiled": {**compiled, "status": engine.compiled.status()}} if compiled else {}),
    }


def _bucket(engine, seqs, cache: int, k: int) -> dict:
    """A compiled torch engine's bucket for a pass of these sessions (sessions, tokens each, keys), padded."""
    compiled = getattr(engine, "compiled", None)
    shape = compiled.shape([(s.id, cache, k, 0) for s in seqs]) if compiled is not None else None
    return {"bucket": list(shape)} if shape else {}


def batched_bench(binary: Path, gguf: Path, args, bandwidth: float) -> dict:
    """llama.cpp's own llama-batched-bench on the same GGUF: its one-token step for each session count."""
    sessions = _ints(args.sessions)
    tg = 4
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-c",
        str(max(sessions) * (args.cache + tg + 1)),
        "-b",
        "2048",
        "-ub",
        str(args.n_ubatch or 2048),
        "-npp",
        str(args.cache),
        "-ntg",
        str(tg),
        "-npl",
        ",".join(map(str, sessions)),
        "-ngl",
        "0" if args.device == "cpu" else "99",
        "--output-format",
        "jsonl",
    ]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    if args.kv_unified == "on":
        cmd.append("-kvu")
    print("llama-batched-bench: " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"llama-batched-bench failed ({out.returncode}): {out.stderr[-800:]}")
    weight_bytes = Path(gguf).stat().st_size
    roofline_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            ms = 1e3 * r["t_tg"] / r["tg"]
            rows.append(
                {
                    "engine": "llama-batched-bench",
                    "sessions": r["pl"],
                    "tokens": 1,
                    "pass_ms": round(ms, 3),
                    "x_roofline": round(ms / roofline_ms, 2),
                }
            )
            print(
                f"  llama-batched-bench {r['pl']:2d} sessions x 1 token: {ms:.3f} ms "
                f"({ms / roofline_ms:.2f}x roofline)",
                flush=True,
            )
    return {
        "engine": "llama-batched-bench",
        "dtype": f"{args.gguf_dtype} GGUF",  # the llamacpp engine's own file
        "binary": str(binary),
        "command": " ".join(cmd),
        "roofline_ms": round(roofline_ms, 4),
        "rows": rows,
    }


def random_gguf(args, log) -> Path:
    """The random GGUF of --gguf-dtype, made once: Q4_0 and Q8_0 written as blocks directly (the GPU run's),
    Q4_K_M by llama.cpp's own quantizer from the F16 one."""
    base = "f16" if args.gguf_dtype == "q4_k_m" else args.gguf_dtype
    gguf = random_target.make(_shape(args), base, directory=args.model_dir, log=log).gguf
    if args.gguf_dtype != "q4_k_m":
        return gguf
    quantized = gguf.with_name(gguf.stem + "-q4_k_m.gguf")
    if not quantized.exists():
        from server_bridge.engines.llamacpp import requantize

        log(f"quantizing {gguf.name} to Q4_K_M (llama.cpp's quantizer)")
        requantize(str(gguf), str(quantized), "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    return quantized


def find_batched_bench() -> Path | None:
    from tools.bench import peer

    server = peer.find_llama_server()
    bench = server.parent / "llama-batched-bench" if server else None
    return bench if bench and os.access(bench, os.X_OK) else None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _llama_options(args) -> dict:
    unified = {"auto": None, "on": True, "off": False}[args.kv_unified]
    return {"kv_unified": unified, "n_ubatch": args.n_ubatch, "flash_attn": args.flash_attn}


def _child(args, argv: list[str], only: str, extra: list[str]) -> dict:
    """Run `--only` in a fresh interpreter: its result as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tools.bench.gpu_engine", *argv, "--only", only, "--result", str(result), *extra]
        if subprocess.run(cmd).returncode:
            raise RuntimeError(f"the {only} run failed: {' '.join(cmd)}")
        return json.loads(result.read_text())


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/gpu")
    ap.add_argument("--engines", default="torch,llamacpp", help="comma-separated: torch, llamacpp")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the torch engine's dtype")
    ap.add_argument(
        "--gguf-dtype",
        default="f16",
        choices=("f16", "f32", "q4_k_m", *random_target.QUANTIZED),
        help="the llamacpp engine's weights",
    )
    ap.add_argument("--model-dir", default=None, help="where the random GGUF is made (default models/build)")
    ap.add_argument("--tiny", action="store_true", help="a toy Llama (checks the script, not the GPU)")
    ap.add_argument("--shape", choices=sorted(random_target.SHAPES), help="the model's shape (default: llama-7b)")
    ap.add_argument("--cache", type=int, default=128, help="cached tokens per session before each pass")
    ap.add_argument("--sessions", default="1,2,4,8,16,32")
    ap.add_argument("--tokens", default="1,2,5,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp CPU threads (0: all cores)")
    ap.add_argument("--kv-unified", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--n-ubatch", type=int, default=0)
    ap.add_argument("--flash-attn", default="auto", choices=("auto", "on", "off"))
    ap.add_argument(
        "--batched-bench",
        default="auto",
        help="llama-batched-bench binary: auto (the cached build, if any), none, or a path",
    )
    ap.add_argument("--only", choices=ENGINES + ("bandwidth",), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.only:  # a child: one engine (or the bandwidth) in this process
        if args.only == "bandwidth":
            result = {"bandwidth_gbs": bandwidth_gbs(args.device, 64 if args.tiny else 2048)}
        else:
            result = measure(args, args.only, args.bandwidth)
        Path(args.result).write_text(json.dumps(result))
        return 0
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(unknown)}: choose from {', '.join(ENGINES)}")
    bw = _child(args, argv, "bandwidth", [])["bandwidth_gbs"]
    print(f"{args.device}: {bw:.0f} GB/s measured (device-to-device copy)", flush=True)
    children = [e for e in engines if not (e == "torch" and "torch-compiled" in engines)]  # timed beside it
    runs = [_child(args, argv, e, ["--bandwidth", str(bw)]) for e in children]
    binary = (
        find_batched_bench()
        if args.batched_bench == "auto"
        else None
        if args.batched_bench == "none"
        else Path(args.batched_bench)
    )
    if binary and "llamacpp" in engines:
        runs.append(batched_bench(binary, random_gguf(args, log=lambda m: None), args, bw))
    gpu = "none"
    if args.device.startswith("cuda"):
        gpu = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], stdout=subprocess.PIPE, text=True
            )
            .stdout.strip()
            .splitlines()[0]
            if _has("nvidia-smi")
            else "cuda"
        )
    shape = _shape(args)
    result = {
        "command": "python -m tools.bench.gpu_engine " + " ".join(argv),
        "shape": shape.__dict__,
        "device": args.device,
        "gpu": gpu,
        "bandwidth_gbs": round(bw, 1),
        "cache": args.cache,
        "runs": runs,
        "rows": [r for run in runs for r in run["rows"]],
    }
    write(Path(args.out), result)
    return 0


def _has(tool: str) -> bool:
    import shutil

    return shutil.which(tool) is not None


def compiled_vs_eager(rows: list[dict]) -> list[str]:
    """The torch engine's compiled pass against its eager one, shape by shape (markdown lines; none without both)."""
    eager = {(r["sessions"], r["tokens"]): r["pass_ms"] for r in rows if r["engine"] == "torch"}
    both = [r for r in rows if r["engine"] == "torch-compiled" and (r["sessions"], r["tokens"]) in eager]
    if not both:
        return []
    md = ["", "**torch: compiled against eager**", ""]
    md += ["| sessions | tokens each | bucket (sessions x tokens x keys) | eager ms | compiled ms | speed-up |"]
    md += ["|---|---|---|---|---|---|"]
    for r in both:
        e = eager[r["sessions"], r["tokens"]]
        bucket = " x ".join(map(str, r.get("bucket", []))) or "eager (no bucket)"
        md.append(
            f"| {r['sessions']} | {r['tokens']} | {bucket} | {e:.3f} | {r['pass_ms']:.3f} | {e / r['pass_ms']:.2f} |"
        )
    return md


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine.json").write_text(json.dumps(result, indent=1))
    md = [
        f"# The engines on {result['gpu']} ({result['shape']['name']} shape, caches of {result['cache']})",
        "",
        f"`{result['command']}`",
        "",
        f"Bandwidth {result['bandwidth_gbs']:.0f} GB/s (device copy).",
        "",
    ]
    for run in result["runs"]:
        compiled = run.get("compiled")
        note = f"; compiled in {compiled['compile_s']} s, {compiled['status']}" if compiled else ""
        md += [f"**{run['engine']}** ({run['dtype']}): roofline {run['roofline_ms']:.3f} ms{note}", ""]
    md += ["| engine | sessions | tokens each | pass ms | x roofline | bucket |", "|---|---|---|---|---|---|"]
    md += [
        f"| {r['engine']} | {r['sessions']} | {r['tokens']} | {r['pass_ms']:.3f} | {r['x_roofline']:.2f} | "
        f"{' x '.join(map(str, r.get('bucket', []))) or '-'} |"
        for r in result["rows"]
    ]
    md += compiled_vs_eager(result["rows"])
    (out / "gpu_engine.md").write_text("\n".join(md) + "\n")
    from tools.plots import line_plot

    series = []
    for name in dict.fromkeys(r["engine"] for r in result["rows"]):
        for k in sorted({r["tokens"] for r in result["rows"] if r["engine"] == name}):
            pts = [r for r in result["rows"] if (r["engine"], r["tokens"]) == (name, k)]
            series.append((f"{name}, {k} tokens", [r["sessions"] for r in pts], [r["x_roofline"] for r in pts]))
    line_plot(
        out / "gpu_engine.png",
        series,
        "sessions per pass",
        "pass time / roofline",
        f"{result['shape']['name']} shape on {result['gpu']}",
    )
    print(f"wrote {out}/gpu_engine.json, .md, .png")


if __name__ == "__main__":
    sys.exit(main())
