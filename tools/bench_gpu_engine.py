"""The torch engine on a GPU against the HBM roofline, with a randomly initialised Llama of 7B shape.

Cost does not depend on the weights' values, so no weights are needed: the model is built from its
config on the device, in bf16. For each (sessions per pass, new tokens per session) the pass time is
set against the roofline, weight bytes / measured bandwidth (a pass must read every weight once;
the bandwidth is timed here with a large device-to-device copy). Aims: a single-session 5-token
pass within 1.5x of the roofline, a 32-session pass within 2x.

    python -m tools.bench_gpu_engine --out bench_results/gpu          # on a CUDA server
    python -m tools.bench_gpu_engine --tiny --device cpu --out /tmp/g  # the same code on a toy model

Writes gpu_engine.json, gpu_engine.md and gpu_engine.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from server_bridge.engine import Pass
from server_bridge.engine_torch import TorchEngine

LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_gbs(device: torch.device, mib: int) -> float:
    """Device memory bandwidth from a large copy (read + write counted)."""
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


def build(shape: dict, device: str, dtype: str, slots: int, max_len: int) -> TorchEngine:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch_dtype)
    return TorchEngine(Path("random"), "llama-7b-shape" if shape is LLAMA_7B else "tiny", device=device,
                       dtype=dtype, max_sequences=slots, max_len=max_len, model=model)


def pass_ms(engine: TorchEngine, seqs, cache: int, k: int, iters: int) -> float:
    batch = [Pass(s, cache, list(range(10, 10 + k)), k) for s in seqs]
    engine.forward(batch)
    _sync(engine.device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        engine.forward(batch)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="a toy Llama (checks the script, not the GPU)")
    ap.add_argument("--cache", type=int, default=128, help="cached tokens per session before each pass")
    ap.add_argument("--sessions", default="1,2,4,8,16,32")
    ap.add_argument("--tokens", default="1,2,5,8")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    sessions = [int(x) for x in args.sessions.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    shape = TINY if args.tiny else LLAMA_7B
    engine = build(shape, args.device, args.dtype, max(sessions), args.cache + max(tokens) + 1)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    bw = bandwidth_gbs(engine.device, 64 if args.tiny else 2048)
    roofline_ms = weight_bytes / (bw * 1e9) * 1e3
    print(f"{engine.name} on {engine.device} in {args.dtype}: {weight_bytes / 2**30:.2f} GiB of weights, "
          f"{bw:.0f} GB/s measured, roofline {roofline_ms:.3f} ms per pass", flush=True)
    seqs = [engine.new_sequence() for _ in range(max(sessions))]
    engine.forward([Pass(s, 0, list(range(3, 3 + args.cache)), 0) for s in seqs])     # warm caches
    rows = []
    for n in sessions:
        for k in tokens:
            ms = pass_ms(engine, seqs[:n], args.cache, k, args.iters)
            rows.append({"sessions": n, "tokens": k, "pass_ms": round(ms, 3), "x_roofline": round(ms / roofline_ms, 2)})
            print(f"  {n:2d} sessions x {k} tokens: {ms:.3f} ms ({ms / roofline_ms:.2f}x roofline)", flush=True)
    result = {"command": "python -m tools.bench_gpu_engine " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": engine.name, "shape": shape, "device": str(engine.device),
              "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "none",
              "dtype": args.dtype, "weight_bytes": weight_bytes, "bandwidth_gbs": round(bw, 1),
              "roofline_ms": round(roofline_ms, 4), "cache": args.cache, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine.json").write_text(json.dumps(result, indent=1))
    md = [f"# Torch engine on {result['gpu']} ({args.dtype}, {engine.name}, caches of {args.cache})", "",
          f"`{result['command']}`", "", f"Roofline: {weight_bytes / 2**30:.2f} GiB / {bw:.0f} GB/s = "
          f"{roofline_ms:.3f} ms", "", "| sessions | tokens each | pass ms | x roofline |", "|---|---|---|---|"]
    md += [f"| {r['sessions']} | {r['tokens']} | {r['pass_ms']:.3f} | {r['x_roofline']:.2f} |" for r in rows]
    (out / "gpu_engine.md").write_text("\n".join(md) + "\n")
    from tools.plots import line_plot

    line_plot(out / "gpu_engine.png", [(f"{k} tokens", sessions, [r["x_roofline"] for r in rows if r["tokens"] == k])
                                       for k in tokens], "sessions per pass", "pass time / roofline",
              f"{engine.name} on {result['gpu']}")
    print(f"wrote {out}/gpu_engine.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
