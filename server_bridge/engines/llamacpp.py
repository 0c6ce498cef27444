"""The `llamacpp` engine: the target in llama.cpp through llama-cpp-python's C API. No torch.

One context holds every session: `n_seq_max` sequences in one unified KV of
`kv_tokens` cells. A batch is one `llama_decode` over all sessions' new tokens,
each with its own sequence id and positions, with no padding; logits are asked
for only at the rows verification uses; a rejected draft leaves with
`llama_memory_seq_rm`. A released sequence's cells go back to the pool, so the
KV memory is the context's size however many sessions come and go.

Images (a vision-language target, `mmproj` given): a pass's image marker at
text index t is not decoded; libmtmd (runtime/vision.py) writes the image
there instead, in C cells that advance the sequence's position by P, and every
later id of that sequence sits P - 1 positions further on. P = C for SmolVLM;
for an M-RoPE model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) P is the image's
max(rows, cols), far fewer than its C tokens. The engine keeps each sequence's
images as (t, P - 1, C - 1), so `start`, `keep`, `truncate` and a sequence's
`length` go on counting text ids while the KV is addressed by position,
kv(t) = t + sum(P_i - 1 for images before t), and holds
t + sum(C_i - 1) cells. Every cut (`truncate`, a rejection's rollback, a
re-open's rewind) is `llama_memory_seq_rm` from kv(t); text is never placed
at or before a position the sequence already holds, as M-RoPE requires.

Early exits: llama.cpp calls the context's eval callback (`cb_eval`) for every
node of the graph as it computes; it asks for the residual stream `l_out-<il>`
of the tapped blocks and hands the taps their rows, during the pass.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from protocol import modelfiles
from protocol.images import PromptImage
from runtime import llamalog
from runtime.vision import MARKERS, MtmdVision, marker_id

from .types import EngineFull, EngineInfo, NoRoom, Pass, Sequence, SequenceIds, check_batch, image_extra

log = logging.getLogger(__name__)


def requantize(src: str, dst: str, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q2_K", verbose: bool | None = None) -> None:
    """llama.cpp's own quantizer from src to dst (allow_requantize: ALL_F32 dequantizes a quantized GGUF).

    Quiet unless verbose (None: EDGESPEC_VERBOSE): llama.cpp's line per tensor goes to dst + ".log",
    kept beside dst, and a failure shows its tail."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = f"{dst}.{os.getpid()}.tmp"  # this process's own: two may make the same target at once
    log_path = dst + ".log"
    if llamalog.verbose() if verbose is None else verbose:
        llamalog.set_verbose(True)
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    else:
        with llamalog.c_output_to(log_path):
            rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(
            f"llama_model_quantize returned {rc} for {src} -> {dst}; the end of its log "
            f"({log_path}):\n{llamalog.tail(log_path)}"
        )
    os.replace(tmp, dst)  # atomic: a half-written file never looks built


def prepare_target(name: str) -> Path:
    """A named target's GGUF, made from the shipped one the first time (F32: ~3 s, no download)."""
    path = modelfiles.build_dir() / modelfiles.TARGETS[name]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info(
            "making %s from %s with llama.cpp's quantizer (F32, a few seconds) ...", path.name, modelfiles.SHIPPED_GGUF
        )
        t0 = time.perf_counter()
        requantize(str(modelfiles.shipped_gguf()), str(path), "LLAMA_FTYPE_ALL_F32")
        log.info("made %s (%.0f MiB) in %.1fs", path.name, path.stat().st_size / 2**20, time.perf_counter() - t0)
    return path


def _quiet_llama() -> None:
    """llama.cpp logs every tensor it loads: keep its errors only, unless EDGESPEC_VERBOSE asks for all."""
    llamalog.set_verbose()


def _ggml():
    """libggml-base from llama-cpp-python's own lib folder: tensor names and reads for the eval callback."""
    import llama_cpp._ggml as g

    lib = g.libggml
    for name, res, args in (
        ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_nelements", ctypes.c_int64, [ctypes.c_void_p]),
        ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
        ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class _Tokenizer:
    """encode(text) -> ids with the target's own vocabulary (tools and tests; the wire carries ids)."""

    def __init__(self, vocab: Any):  # llama_vocab_p
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        import llama_cpp as L

        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, True)
        if n < 0:
            raise ValueError(f"could not tokenize {text[:40]!r}")
        return list(buf[:n])


def weight_type(L: ModuleType, model: Any) -> tuple[str, str]:
    """The weights' type from the GGUF's general.file_type: ("float16", "F16"), ("q4_k_m", "Q4_K_M"), ...

    The first is what welcome, /healthz and /metrics call the dtype (float32/float16/bfloat16 for
    unquantized weights, as the torch engine names them; llama.cpp's own name, lower-cased, otherwise)."""
    buf = ctypes.create_string_buffer(64)
    n = L.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
    names = {
        getattr(L, a): a.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
        for a in dir(L)
        if a.startswith("LLAMA_FTYPE_") and a != "LLAMA_FTYPE_GUESSED"
    }
    try:
        ftype = names.get(int(buf.value), f"ftype {buf.value.decode()}") if n > 0 else "unknown"
    except ValueError:
        ftype = "unknown"
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(ftype, ftype.lower()), ftype


FLASH_ATTN = ("auto", "on", "off")


MIN_STREAM_CELLS = 2048  # kv_unified auto: per-sequence streams only when each holds this many tokens
CPU_UBATCH = 128  # n_ubatch 0 on the CPU without exits: tokens per micro-batch (LlamaCppEngine._ubatch)


def _unified(kv_unified: bool | None, tap_layers: list[int] | None, offload: bool, cells_each: int) -> bool:
    """kv_unified resolved: None picks per-sequence streams only where layers are offloaded, no exits are tapped
    and each stream holds MIN_STREAM_CELLS (a whole context; many sessions share a pool)."""
    if kv_unified is None:
        kv_unified = not offload or bool(tap_layers) or cells_each < MIN_STREAM_CELLS
    if not kv_unified and tap_layers:
        raise ValueError(
            "early exits need kv_unified: per-sequence KV streams split a batch by sequence, "
            "and the tapped rows would arrive out of order"
        )
    return kv_unified


def _invariant(
    tap_layers: list[int] | None, kv_unified: bool | None, n_ubatch: int, flash_attn: str
) -> tuple[bool, int, str]:
    """The settings of the batch-invariant mode: (kv_unified, n_ubatch, flash_attn).

    llama.cpp's rows depend on the pass's shape in every weight type on this CPU (F32, F16, Q8_0, Q4_K, Q4_0:
    docs/benchmarks/batch_invariant_cpu/): a matmul over one token takes other kernels than over many, and
    attention's sums follow the KV cells. The mode computes every row as the one-token pass does: each
    sequence in a llama_decode call of its own (`_chunks`), one token a micro-batch, in its own KV stream
    (cells in position order), with flash attention (which sums over a sequence's own cells in their order;
    without it, a row's bits also follow the other sequences' cells). Measured: 0 of 96 rows differ, alone or
    sharing passes (tools/bench/divergence.py, llamacpp:invariant). Its price is the batching: a verify of
    k tokens costs k one-token passes."""
    if tap_layers:
        raise ValueError(
            "batch_invariant on the llamacpp engine runs each session's tokens one at a time in its own KV stream; "
            "early exits need one unified pass: turn exits off, or use the torch engine (its batch-invariant mode "
            "keeps the exits)"
        )
    if kv_unified or n_ubatch not in (0, 1) or flash_attn == "off":
        raise ValueError(
            "batch_invariant on the llamacpp engine needs kv_unified off, n_ubatch 0 (one token a micro-batch) "
            f"and flash attention (got kv_unified {kv_unified}, n_ubatch {n_ubatch}, flash_attn {flash_attn})"
        )
    return False, 1, "on"


class LlamaCppEngine:
    def __init__(
        self,
        path: Path,
        name: str,
        threads: int = 0,
        max_sequences: int = 64,
        kv_tokens: int = 0,
        n_gpu_layers: int = -1,
        tap_layers: list[int] | None = None,
        kv_type: str = "f16",
        kv_unified: bool | None = None,
        n_ubatch: int = 0,
        flash_attn: str = "auto",
        mmproj: str | Path | None = None,
        vision_threads: int = 1,
        batch_invariant: bool = False,
    ):
        """kv_unified: one KV pool shared by every sequence (True), or a stream of kv_tokens/max_sequences
        cells per sequence (False: faster batched passes on a GPU, measured on an H100); None picks False
        when layers are offloaded, no exits are tapped and each stream holds MIN_STREAM_CELLS, else True.
        n_ubatch: tokens per llama.cpp micro-batch (0: `_ubatch`).
        flash_attn: llama.cpp's flash-attention switch (auto: on where the backend has it). mmproj: the
        target's vision projector (libmtmd's GGUF): passes may then carry images; vision_threads: libmtmd's
        (1: see runtime/vision.py). batch_invariant: every row as the one-token pass computes it (`_invariant`)."""
        import llama_cpp as L

        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}")
        self.L = L
        t0 = time.perf_counter()
        n_gpu, offload = self._load_model(path, n_gpu_layers)
        self.name = name
        self.path = Path(path)  # the exits read its norm and LM head
        self._read_model(kv_type)
        self.max_sequences = min(max_sequences, 256)  # LLAMA_MAX_SEQ
        self.kv_capacity = kv_tokens or 64 * 1024
        self.n_batch = 2048  # tokens per llama_decode call
        self.batchable = True
        self.packed = True  # llama_batch: each token with its own sequence and position
        self.invariant = batch_invariant
        if batch_invariant:
            kv_unified, n_ubatch, flash_attn = _invariant(tap_layers, kv_unified, n_ubatch, flash_attn)
        self.kv_unified = kv_unified = _unified(kv_unified, tap_layers, offload, self.kv_capacity // self.max_sequences)
        # per-sequence streams divide the cells evenly: a session holds at most this many tokens
        self.seq_capacity = self.kv_capacity if kv_unified else self.kv_capacity // self.max_sequences
        self.tap_names: dict[bytes, int] = {f"l_out-{l - 1}".encode(): l for l in (tap_layers or [])}
        self._taps: list[tuple[int, int, Pass]] | None = None  # the running chunk's (first row, rows, pass)
        cparams = self._context_params(threads, kv_type, kv_unified, n_ubatch or self._ubatch(offload), flash_attn)
        self.vision: MtmdVision | None = None
        if mmproj is not None:
            self.vision = MtmdVision(mmproj, self.model, threads=vision_threads, use_gpu=offload)
            if self.image_token_id is None:
                raise ValueError(
                    f"{path} has a projector ({mmproj}) but no image marker token "
                    f"({', '.join(MARKERS)}) in its vocabulary"
                )
        # seq id -> [(text index, extra positions, extra cells)] of its images, in order
        self._images: dict[int, list[tuple[int, int, int]]] = {}
        self._make_context(cparams, path)
        self.threads = cparams.n_threads
        dtype, self.ftype = weight_type(L, self.model)
        self.info = EngineInfo(
            "llamacpp",
            "gpu" if offload else "cpu",
            dtype,
            {
                "n_gpu_layers": n_gpu,
                "kv_type": kv_type,
                "threads": self.threads,
                "weights": self.ftype,
                "kv_unified": kv_unified,
                "n_ubatch": int(cparams.n_ubatch),
                "flash_attn": flash_attn,
                "vision": self.vision is not None,
                "batch_invariant": batch_invariant,
            },
        )
        self._log_loaded(time.perf_counter() - t0, mmproj)

    def _load_model(self, path: Path, n_gpu_layers: int) -> tuple[int, bool]:
        """Load the weights (n_gpu_layers < 0: all on the GPU where llama.cpp has one): (layers offloaded,
        whether any are)."""
        from runtime.native import warn_if_numpy_first

        L = self.L
        _quiet_llama()
        L.llama_backend_init()
        gpu = bool(L.llama_supports_gpu_offload())
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = (0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers) if gpu else 0
        offload = gpu and mparams.n_gpu_layers > 0
        warn_if_numpy_first(offload)
        self.model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._gpu = gpu
        return int(mparams.n_gpu_layers) if gpu else 0, offload

    def _read_model(self, kv_type: str) -> None:
        """The vocabulary and the shapes the verifier and the memory budget need."""
        L = self.L
        vocab = L.llama_model_get_vocab(self.model)
        self.vocab_size = int(L.llama_vocab_n_tokens(vocab))
        self.tokenizer = _Tokenizer(vocab)
        pieces = [L.llama_vocab_get_text(vocab, i) for i in range(self.vocab_size)]
        self.vocab_hash = modelfiles.vocab_hash(pieces)  # over the real part: a [PAD] tail is not hashed
        self.vocab_real = modelfiles.real_vocab_size(pieces)  # the ids verification may produce: [0, vocab_real)
        self.image_token_id = marker_id(vocab)  # SmolVLM's <image>; None in a text vocabulary
        self.eos_ids = sorted({int(t) for t in (L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)) if t >= 0})
        self.n_layers = int(L.llama_model_n_layer(self.model))
        self.hidden_size = int(L.llama_model_n_embd(self.model))
        n_head, n_head_kv = int(L.llama_model_n_head(self.model)), int(L.llama_model_n_head_kv(self.model))
        kv_bytes = {"f32": 4, "f16": 2}[kv_type]
        self.kv_bytes_per_token = 2 * self.n_layers * n_head_kv * (self.hidden_size // n_head) * kv_bytes

    def _ubatch(self, offload: bool) -> int:
        """The micro-batch where the config leaves it (n_ubatch 0): the whole call where exits are tapped (their
        rows then arrive in order) or layers are offloaded; on the CPU, CPU_UBATCH tokens, so that a pass of many
        robots' rounds keeps its logits tile in cache (a pass of 64 sessions x 5 rows: 1.6 ms a round against
        2.3 in one micro-batch, tiny random target, one thread; docs/benchmarks/fleet_cpu)."""
        return self.n_batch if self.tap_names or offload else CPU_UBATCH

    def _context_params(self, threads: int, kv_type: str, kv_unified: bool, n_ubatch: int, flash_attn: str) -> Any:
        """llama_context_params for the sizes set so far; installs the eval callback where exits are tapped."""
        L = self.L
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.kv_capacity
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = n_ubatch
        if self.tap_names and cparams.n_ubatch != self.n_batch:
            raise ValueError("early exits need the whole call in one micro-batch (n_ubatch 0)")
        cparams.n_seq_max = self.max_sequences
        cparams.kv_unified = kv_unified
        cparams.flash_attn_type = {
            "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        cparams.n_threads = cparams.n_threads_batch = threads or max(1, os.cpu_count() or 1)
        ggml_type = {"f32": 0, "f16": 1}[kv_type]
        cparams.type_k = cparams.type_v = ggml_type
        cparams.no_perf = True
        if self.tap_names:
            self._ggml = _ggml()
            self._cb = L.ggml_backend_sched_eval_callback(self._on_tensor)  # kept alive with the engine
            cparams.cb_eval = self._cb
            cparams.cb_eval_user_data = None
        return cparams

    def _make_context(self, cparams: Any, path: Path) -> None:
        """The context, its KV memory, one reusable batch and the sequence ids."""
        L = self.L
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {self.kv_capacity} tokens for {path}")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        # numpy views of the batch's arrays, made once: fill_batch runs for every token of a stream
        self._batch_views = tuple(
            np.ctypeslib.as_array(a, shape=(self.n_batch,))
            for a in (self.batch.token, self.batch.pos, self.batch.logits, self.batch.n_seq_id)
        )
        self.ids = SequenceIds(self.max_sequences)
        self._used = 0  # KV cells held by live sequences
        self._seqs: dict[int, Sequence] = {}

    def _log_loaded(self, seconds: float, mmproj: str | Path | None) -> None:
        log.info(
            "llamacpp engine: %s (%s weights) in %.1fs (%d layers, vocab %d, %d sequences, KV %d tokens %s %s, "
            "%d threads, GPU offload %s, exits tapped at %s, images %s)",
            self.name,
            self.ftype,
            seconds,
            self.n_layers,
            self.vocab_size,
            self.max_sequences,
            self.kv_capacity,
            self.info.extra["kv_type"],
            "unified" if self.kv_unified else f"in streams of {self.seq_capacity}",
            self.threads,
            self.info.extra["n_gpu_layers"] if self._gpu else "not built in",
            self.tapped or "none",
            f"through {Path(mmproj).name}" if mmproj is not None and self.vision else "no",
        )

    @property
    def tapped(self) -> list[int]:
        """The decoder blocks whose output the eval callback reads (early exits), 1-based."""
        return sorted(self.tap_names.values())

    # ------------------------------------------------------------------ sequences

    def new_sequence(self) -> Sequence:
        seq = Sequence(self.ids.take(self._clear))
        self._seqs[seq.id] = seq
        return seq

    def free(self, seq: Sequence) -> None:
        self.ids.release(seq.id)

    def _clear(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        self.L.llama_memory_seq_rm(self.mem, seq_id, 0, -1)
        if seq is not None:
            self._used -= self.kv_cells(seq, seq.length)
            seq.length = 0
        self._images.pop(seq_id, None)

    def truncate(self, seq: Sequence, n: int) -> None:
        if n < seq.length:
            self._cut(seq, n)

    def _cut(self, seq: Sequence, n: int) -> None:
        """Drop the sequence's KV from text index n on (images at n or later included), by position."""
        self.L.llama_memory_seq_rm(self.mem, seq.id, self.kv_pos(seq, n), -1)
        self._used -= self.kv_cells(seq, seq.length) - self.kv_cells(seq, n)
        seq.length = n
        if seq.id in self._images:
            kept = [image for image in self._images[seq.id] if image[0] < n]
            if kept:
                self._images[seq.id] = kept
            else:
                del self._images[seq.id]

    def kv_pos(self, seq: Sequence, t: int) -> int:
        """The KV position of text index t: t plus the extra positions of the images before it."""
        return t + sum(extra for i, extra, _ in self._images.get(seq.id, ()) if i < t)

    def kv_cells(self, seq: Sequence, t: int) -> int:
        """KV cells the first t text ids take: t plus the extra cells (tokens) of the images among them."""
        return t + sum(extra for i, _, extra in self._images.get(seq.id, ()) if i < t)

    @property
    def kv_used(self) -> int:
        return self._used

    def to_numpy(self, rows: np.ndarray) -> np.ndarray:
        return rows

    # ------------------------------------------------------------------ the pass

    def forward(self, batch: list[Pass]) -> list[np.ndarray]:
        """One llama_decode per n_batch tokens over every session's new tokens; logits [keep, vocab] each.

        If a call fails, every sequence is cut back to its pass's start and the error raised.
        """
        check_batch(batch)
        extra = self._check_images(batch)  # extra KV cells, before anything is written: bad bytes raise here
        untapped = {l for p in batch for l in (p.taps or {})} - set(self.tap_names.values())
        if untapped:
            raise ValueError(
                f"layers {sorted(untapped)} are not tapped: a llamacpp engine taps only the layers "
                "named when it starts (tap_layers)"
            )
        self.ids.reclaim(self._clear)
        for p in batch:
            self.truncate(p.seq, p.start)  # trust the caller's committed length, never our own
        cells = [len(p.new_ids) + e for p, e in zip(batch, extra, strict=True)]  # KV cells each pass writes
        for p, n in zip(batch, cells, strict=True):
            if self.kv_cells(p.seq, p.start) + n > self.seq_capacity:
                raise EngineFull(
                    f"a session's KV stream holds {self.seq_capacity} tokens, the pass needs "
                    f"{self.kv_cells(p.seq, p.start) + n}"
                )
        if self._used + sum(cells) > self.kv_capacity:
            raise NoRoom(
                f"the pass needs {sum(cells)} KV cells, {self.kv_capacity - self._used} of {self.kv_capacity} are free"
            )
        text = [p for p in batch if not p.images]
        flat = [(p, j) for p in text for j in range(len(p.new_ids))]
        out_rows: list[np.ndarray] = []
        by_pass: dict[int, np.ndarray] = {}
        try:
            for chunk in self._chunks(flat):
                out_rows.append(self._decode(chunk))
            for p in batch:  # prompts with images: rare (opens), each on its own
                if p.images:
                    by_pass[id(p)] = self._forward_images(p)
        except BaseException:
            for p in batch:
                self._cut(p.seq, p.start)
            raise
        if len(out_rows) == 1:  # one call (a stream's token, a round): no second copy
            logits = out_rows[0]
        else:
            logits = np.concatenate(out_rows) if out_rows else np.zeros((0, self.vocab_size), np.float32)
        result, at = [], 0
        for p in batch:
            if p.images:
                result.append(by_pass[id(p)])
            else:
                result.append(logits[at : at + p.keep])
                at += p.keep
        return result

    def _chunks(self, flat: list[tuple[Pass, int]]) -> list[list[tuple[Pass, int]]]:
        """A pass's tokens as llama_decode calls: n_batch at a time, or in the invariant mode one sequence a call."""
        if not self.invariant:
            return [flat[c0 : c0 + self.n_batch] for c0 in range(0, len(flat), self.n_batch)]
        calls: list[list[tuple[Pass, int]]] = []
        for p, j in flat:
            if j == 0 or len(calls[-1]) == self.n_batch:
                calls.append([])
            calls[-1].append((p, j))
        return calls

    # ------------------------------------------------------------------ images

    def image_positions(self, image: PromptImage) -> int:
        """Positions the image's marker advances a sequence by (not its KV cells: M-RoPE). ValueError: no image,
        or no projector; vision.UnknownImage: only its sha256 came and it is not cached."""
        return self._seeing().positions(image)

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes (from the cache when only its sha256 came; UnknownImage if not held)."""
        return self._seeing().resolve(image)

    def _seeing(self) -> MtmdVision:
        if self.vision is None:
            raise ValueError(f"the target {self.name} reads text only (no mmproj): a pass with images")
        return self.vision

    def _check_images(self, batch: list[Pass]) -> list[int]:
        """Each pass's extra KV cells for its images, once types.image_extra found them all readable."""
        return image_extra(batch, self.image_token_id, self._seeing)

    def _forward_images(self, p: Pass) -> np.ndarray:
        """One sequence's pass with images: its text runs between them through _decode, each image
        through libmtmd at its KV position; logits [keep, vocab], an image's row the one after it."""
        L, n, first_kept = self.L, len(p.new_ids), len(p.new_ids) - p.keep
        images, vision = p.images, self.vision
        assert images and vision is not None  # forward sends only passes with images here, after _check_images
        rows: list[np.ndarray] = []
        a = 0
        for i in sorted(images) + [n]:
            if i > a:  # the text ids a..i-1
                keep = max(0, i - max(a, first_kept))
                part = Pass(p.seq, p.start + a, p.new_ids[a:i], keep, p.taps if i == n else None)
                flat = [(part, j) for j in range(i - a)]
                for c0 in range(0, len(flat), self.n_batch):
                    rows.append(self._decode(flat[c0 : c0 + self.n_batch]))
            if i == n:
                break
            at = self.kv_pos(p.seq, p.start + i)
            used = vision.eval(self.ctx, p.seq.id, at, images[i], self.n_batch, logits_last=i >= first_kept)
            cells = vision.cells(images[i])
            self._images.setdefault(p.seq.id, []).append((p.start + i, used - 1, cells - 1))
            p.seq.length = p.start + i + 1
            self._used += cells
            if i >= first_kept:
                last = L.llama_get_logits_ith(self.ctx, -1)  # the row after the image
                rows.append(np.ctypeslib.as_array(last, shape=(1, self.vocab_size)).copy())
            a = i + 1
        return np.concatenate(rows) if rows else np.zeros((0, self.vocab_size), np.float32)

    def fill_batch(self, chunk: list[tuple[Pass, int]]) -> tuple[int, list[tuple[int, int, Pass]]]:
        """Write (pass, index in its new ids) tokens into the llama_batch; (logits rows asked for, tapped rows)."""
        b, n = self.batch, len(chunk)
        token, pos, want, n_seq_id = self._batch_views
        n_seq_id[:n] = 1
        n_out = 0
        taps: dict[int, tuple[int, int, Pass]] = {}
        base: dict[int, int] = {}  # a pass's first KV position (images shift it)
        for i, (p, j) in enumerate(chunk):
            token[i] = p.new_ids[j]
            b0 = base.get(id(p))
            if b0 is None:
                b0 = base[id(p)] = self.kv_pos(p.seq, p.start)
            pos[i] = b0 + j
            b.seq_id[i][0] = p.seq.id
            kept = j >= len(p.new_ids) - p.keep
            want[i] = kept
            n_out += kept
            if p.taps and kept:
                row0, count, _ = taps.get(id(p), (i, 0, p))
                taps[id(p)] = (row0, count + 1, p)
        b.n_tokens = n
        return n_out, list(taps.values())

    def _decode(self, chunk: list[tuple[Pass, int]]) -> np.ndarray:
        """One llama_decode of (pass, index in its new ids) tokens; the logits rows it asked for, in order."""
        L, b, n = self.L, self.batch, len(chunk)
        n_out, taps = self.fill_batch(chunk)
        self._taps = taps or None
        try:
            rc = L.llama_decode(self.ctx, b)
        finally:
            self._taps = None
        if rc != 0:
            raise (
                EngineFull(f"llama_decode found no room for {n} tokens (code {rc})")
                if rc == 1
                else RuntimeError(f"llama_decode failed with code {rc}")
            )
        for p, j in chunk:
            if j == 0:
                p.seq.length = p.start
            p.seq.length += 1
            self._used += 1
        if not n_out:
            return np.zeros((0, self.vocab_size), np.float32)
        rows = np.empty((n_out, self.vocab_size), np.float32)  # llama.cpp reuses its buffer next call
        ctypes.memmove(rows.ctypes.data, L.llama_get_logits(self.ctx), rows.nbytes)
        return rows

    # ------------------------------------------------------------------ early exits

    def _on_tensor(self, tensor: int, ask: bool, _user: Any) -> bool:
        """llama.cpp's eval callback: asked for every node, then handed the ones we asked for."""
        taps = self._taps
        if taps is None:
            return False
        name = self._ggml.ggml_get_name(tensor)
        layer = self.tap_names.get(name)
        if layer is None or not any(layer in (p.taps or {}) for _, _, p in taps):
            return False
        if ask:
            return True
        try:
            n = self._ggml.ggml_nelements(tensor)
            hidden = np.empty((n // self.hidden_size, self.hidden_size), np.float32)  # [tokens, hidden]
            self._ggml.ggml_backend_tensor_get(tensor, hidden.ctypes.data, 0, hidden.nbytes)
            for row0, count, p in taps:
                fn = (p.taps or {}).get(layer)
                if fn is not None:
                    fn(hidden[row0 : row0 + count])  # [keep, hidden]
        except Exception:  # never raise through C: the taps log their own failures
            log.exception("reading layer %d for the early exits failed", layer)
        return True
