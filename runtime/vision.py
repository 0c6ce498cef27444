"""A prompt's images into a llama.cpp sequence, through libmtmd (llama.cpp's multimodal library).

    vision = MtmdVision("target-mmproj.gguf", model)    # the projector for a loaded llama_model
    n = vision.positions(image)                          # positions the image's one marker advances a sequence by
    c = vision.cells(image)                              # KV cells it takes (its tokens: > n for M-RoPE)
    vision.eval(ctx, seq_id, n_past, image, n_batch)     # writes it into seq_id from n_past; the next is n_past + n
    image = vision.resolve(image)                        # its bytes from the cache when only the sha256 came
    vision.prepare(image)                                # decode and tile now, in this thread (not the model's)

A prompt holds one image marker token per image (protocol/images.py); libmtmd expands one marker to
the model's layout for that image. For SmolVLM (Idefics3) that is more than the image
embeddings: each 64 x 64 tile (the test VLM's size) is wrapped in its own text tokens,
`<fake_token_around_image><row_R_col_C>` + 4 embeddings, rows end in "\n", and the overview follows
as `<fake_token_around_image><global-img>` + 4 embeddings + `<fake_token_around_image>`: a square
image on the test VLM takes 33 positions (20 embeddings, 13 text tokens). For the Qwen-VL family the
marker is `<|image_pad|>`, and the prompt already holds the text libmtmd wraps an image in (the chat
template writes `<|vision_start|><|image_pad|><|vision_end|>`, `placeholder`): the marker stands for the
image chunk alone. Both sides tokenize the text around a marker on their own; only what stands for the
marker comes from here.

Positions, not token counts (DESIGN invariant 5). An image takes `cells` KV cells (its tokens) and
advances the sequence's position by `positions` (libmtmd's n_pos). They are equal for SmolVLM; for an
M-RoPE model (Qwen2-VL, Qwen2.5-VL: MROPE; Qwen3-VL: IMROPE) the image's embeddings carry 2-D positions
(libmtmd's helper writes 4 x n_tokens of them: n_past on the first plane, n_past + row and n_past + col
on the next two), and the image advances the position by max(rows, cols), far fewer than its tokens.
Text after it sits at n_past + n_pos + i (llama.cpp copies a token batch's 1-D position to every plane),
a new batch must start past the sequence's largest position, and a sequence is cut by position
(`llama_memory_seq_rm`): every cell of an M-RoPE image holds the image's first position, so a cut after
the image keeps it all and a cut at or before it drops it all.

Tokenizing an image (decoding the JPEG, resizing, cutting tiles) is kept for the last CACHED images
by sha256, with the image's bytes, so an image sent once is known by its hash after (a re-open sends
only the hash); the vision tower itself runs on every `eval`.

Untrusted bytes: the header's width and height are checked against protocol/images.py's limits before
libmtmd sees the bytes, a PNG's image data must inflate to no more than that header implies (stb_image
inflates all there is), and the bitmap it decodes must have the size the header declared. libmtmd hands
bytes stb_image cannot decode to ffmpeg (as a video) where its build has video support: it is pointed at a
directory with no ffmpeg, so it never does. The server decodes and tiles an open's images with `prepare`
in a thread of its own, before the open reaches the model thread, which then finds them READY and only
evaluates them (libmtmd documents mtmd_tokenize and the bitmap helper as thread-safe on a shared context);
anything else (`positions`, `eval`, the cache) belongs to one thread, the model's.

One thread by default: libmtmd with two threads on a busy two-core machine took 4.8 s for what one
thread does in 7 ms (the threads spin against the model's own).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from protocol.images import ImageError, PromptImage, check_header, check_png_data

CACHED = 8  # images kept ready by sha256 (ImageCache: tokenized or preprocessed, with their bytes), per engine
READY = 8  # images made ready ahead by `prepare`, not yet taken by the model thread (beyond: the oldest is dropped,
# and made again when its open runs)
NO_FFMPEG = b"/dev/null"  # where libmtmd looks for ffmpeg for bytes stb_image cannot decode: nothing is found there
MARKERS = ("<image>", "<|image_pad|>")  # the image marker tokens this reads (SmolVLM's, Qwen-VL's); one id per image
# Markers that stand for the image's embeddings alone: the prompt holds the text libmtmd wraps them in (before, after).
# SmolVLM's <image> stands for libmtmd's whole layout, its tiles' text included.
WRAPPED = {"<|image_pad|>": ("<|vision_start|>", "<|vision_end|>")}
_TEXT = 0  # MTMD_INPUT_CHUNK_TYPE_TEXT
PROJECTION_IS_TEXT_WIDTH = {"idefics3"}  # projector types whose clip.vision.projection_dim is the text width


class UnknownImage(LookupError):
    """Only the image's sha256 came, and its bytes are no longer cached (the wire's `unknown_image`)."""


def image_data(image: PromptImage) -> bytes:
    """The image's bytes; UnknownImage when only its sha256 came (ImageCache.make is never handed one)."""
    if image.data is None:
        raise UnknownImage(f"image {image.sha256[:12]} came as its sha256 alone: send its bytes")
    return bytes(image.data)


class Ready(Protocol):
    """An image made ready for a vision engine (tokenized, or preprocessed), holding the image's bytes."""

    @property
    def data(self) -> bytes: ...


R = TypeVar("R", bound=Ready)


class ImageCache(Generic[R]):
    """Images made ready by sha256, shared by both engines' visions (MtmdVision here, the torch engine's
    server_bridge/engines/vision_torch.py): the last `CACHED` the model thread used, with their bytes, so an image
    sent once is known by its hash after; and up to `READY` made ahead by `prepare` in another thread (beyond:
    the oldest is dropped, and made again when its open runs). Thread-safe; `make` runs outside the lock.

    make(image) -> the ready image (raises ValueError for bytes that are no image); drop(entry) frees what an
    entry holds outside Python (libmtmd's chunks) when it leaves the cache."""

    def __init__(
        self,
        make: Callable[[PromptImage], R],
        drop: Callable[[R], None] | None = None,
        cached: int = CACHED,
        ready: int = READY,
    ):
        self._make = make
        self._drop = drop or (lambda entry: None)
        self._cached, self._ready_max = cached, ready
        self._cache: OrderedDict[str, R] = OrderedDict()  # sha256 -> entry, least recently used first
        self._ready: OrderedDict[str, R] = OrderedDict()  # made by `prepare`, not yet taken by `get`
        self._lock = threading.Lock()

    def get(self, image: PromptImage) -> R:
        """The image made ready: from the cache, from what `prepare` made, or made now; UnknownImage when only
        its sha256 came and it is held nowhere."""
        with self._lock:
            hit = self._cache.get(image.sha256)
            if hit is not None:
                self._cache.move_to_end(image.sha256)
                return hit
            entry = self._ready.pop(image.sha256, None)
        if entry is None:
            if image.data is None:
                raise UnknownImage(
                    f"image {image.sha256[:12]} came as its sha256 alone and is not cached: send its bytes again"
                )
            entry = self._make(image)  # not prepared ahead (a direct caller), or dropped from READY
        with self._lock:
            self._cache[image.sha256] = entry
            gone = [self._cache.popitem(last=False)[1] for _ in range(len(self._cache) - self._cached)]
        for old in gone:
            self._drop(old)
        return entry

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes: as it came, or filled in from the cache; UnknownImage if not cached."""
        if image.data is not None:
            return image
        return replace(image, data=self.get(image).data)

    def prepare(self, image: PromptImage) -> None:
        """Make the image ready now, in the calling thread, so that the model thread finds it ready. Raises as
        `make`; an image that came as its hash alone is left to the model thread."""
        with self._lock:
            if image.data is None or image.sha256 in self._cache or image.sha256 in self._ready:
                return
        entry = self._make(image)
        with self._lock:
            if image.sha256 in self._ready:  # made meanwhile by another thread
                gone = [entry]
            else:
                self._ready[image.sha256] = entry
                gone = [self._ready.popitem(last=False)[1] for _ in range(len(self._ready) - self._ready_max)]
        for old in gone:
            self._drop(old)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            gone = list(self._cache.values()) + list(self._ready.values())
            self._cache.clear()
            self._ready.clear()
        for old in gone:
            self._drop(old)


def marker_id(vocab: Any) -> int | None:
    """The id of the model's image marker (SmolVLM's `<image>`, Qwen-VL's `<|image_pad|>`) in a llama.cpp
    vocabulary; None if it has none."""
    found = marker_token(vocab)
    return None if found is None else found[0]


def marker_token(vocab: Any) -> tuple[int, str] | None:
    """(id, text) of the model's image marker in a llama.cpp vocabulary; None if it has none."""
    import llama_cpp as L

    for text in MARKERS:
        raw = text.encode()
        buf = (L.llama_token * 8)()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, True)  # parse_special: one id
        if n == 1 and L.llama_vocab_get_text(vocab, buf[0]) == raw:
            return int(buf[0]), text
    return None


def placeholder(marker: str) -> str:
    """The text that stands for one image in a prompt written by hand: the marker, in what libmtmd would wrap
    the image in (Qwen-VL's `<|vision_start|><|image_pad|><|vision_end|>`, as its chat template writes it)."""
    before, after = WRAPPED.get(marker, ("", ""))
    return before + marker + after


@dataclass(eq=False)
class _Tokenized:
    """One image as libmtmd tokenized it, cached by sha256."""

    chunks: object  # mtmd_input_chunks of the marker alone (owned: freed when dropped from the cache)
    parts: list[Any]  # the chunks that stand for the marker, in order (Qwen-VL: the image chunk alone)
    positions: int  # positions they advance a sequence by (libmtmd's n_pos; M-RoPE: max(rows, cols) for an image)
    cells: int  # KV cells they take (their tokens)
    data: bytes


class MtmdVision:
    """libmtmd's projector for one llama_model: image -> positions, image -> prefilled KV. (llama.cpp's and
    libmtmd's handles, opaque ctypes pointers, are typed Any.)"""

    wrappers: tuple[str, str] | None = None  # text libmtmd wraps an image in that the prompt holds (WRAPPED)
    mrope: bool = False  # the model places an image's embeddings at 2-D positions (Qwen-VL)

    def __init__(self, mmproj_path: str | Path, llama_model: Any, threads: int = 1, use_gpu: bool = False):
        import llama_cpp as L
        import llama_cpp.mtmd_cpp as mtmd

        self.L, self.mtmd = L, mtmd
        self.path = Path(mmproj_path)
        self.mctx = None
        self.images: ImageCache[_Tokenized] = ImageCache(self._entry, self._free)  # sha256 -> the image tokenized
        self.vocab = L.llama_model_get_vocab(llama_model)
        found = marker_token(self.vocab)
        self.wrappers = WRAPPED.get(found[1]) if found else None
        check_mmproj(self.path, int(L.llama_model_n_embd(llama_model)))
        _quiet(mtmd)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings, params.warmup = use_gpu, threads, False, False
        self.mctx = mtmd.mtmd_init_from_file(str(self.path).encode(), llama_model, params)
        if not self.mctx:
            raise ValueError(
                f"libmtmd could not load {self.path} as a projector for this model (llama.cpp's log "
                "says why): is it the mmproj made with this model?"
            )
        if not mtmd.mtmd_support_vision(self.mctx):
            self.close()
            raise ValueError(f"{self.path} is a projector without a vision encoder (audio only?)")
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.mctx))
        self.threads = threads
        self.marker = mtmd.mtmd_default_marker()

    # ------------------------------------------------------------------ images

    def positions(self, image: PromptImage) -> int:
        """Positions the image's marker advances a sequence by (text tokens around the tiles included).

        Raises ValueError for bytes that are no image, UnknownImage for a hash no longer cached."""
        return self._tokenized(image).positions

    def cells(self, image: PromptImage) -> int:
        """KV cells the image's marker takes: its tokens (for M-RoPE more than its positions). Raises as
        `positions`."""
        return self._tokenized(image).cells

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes: as it came, or filled in from the cache; UnknownImage if not cached."""
        return self.images.resolve(image)

    def prepare(self, image: PromptImage) -> None:
        """Decode and tile the image now, in the calling thread, so that the model thread finds it ready.

        Thread-safe; raises ValueError for bytes that are no image (ImageError for an image over the limits,
        before anything is decoded). An image that came as its hash alone is left to the model thread."""
        self.images.prepare(image)

    def eval(
        self, ctx: Any, seq_id: int, n_past: int, image: PromptImage, n_batch: int, logits_last: bool = False
    ) -> int:
        """Encode the image and decode it into seq_id from position n_past; the positions it advanced by.

        libmtmd's helper places each chunk (an M-RoPE image's 4 x n_tokens positions included) and returns the
        next free position, which the text after the image starts at. logits_last: the context's last logits
        row is the one after the image. On failure the KV from n_past on may hold part of the image: the caller
        cuts it back (by position)."""
        entry = self._tokenized(image)
        pos = n_past
        for i, chunk in enumerate(entry.parts):
            new_n_past = self.L.llama_pos(pos)
            last = logits_last and i == len(entry.parts) - 1
            if last and self.mtmd.mtmd_input_chunk_get_type(chunk) != _TEXT:  # the helper asks no logits of an image
                rc = self._decode_image(ctx, seq_id, chunk, pos, n_batch)
                new_n_past.value = pos + int(self.mtmd.mtmd_input_chunk_get_n_pos(chunk))
            else:
                rc = self.mtmd.mtmd_helper_eval_chunk_single(
                    self.mctx, ctx, chunk, pos, seq_id, n_batch, last, ctypes.byref(new_n_past)
                )
            if rc != 0:
                raise RuntimeError(
                    f"libmtmd could not evaluate image {image.sha256[:12]} at position {pos} "
                    f"(mtmd_helper_eval_chunk_single returned {rc})"
                )
            pos = new_n_past.value
        if pos - n_past != entry.positions:
            raise RuntimeError(
                f"image {image.sha256[:12]} took {pos - n_past} positions, its chunks say {entry.positions}"
            )
        return entry.positions

    def _decode_image(self, ctx: Any, seq_id: int, chunk: Any, n_past: int, n_batch: int) -> int:
        """An image chunk decoded as libmtmd's helper decodes it (its embeddings, at the positions libmtmd gives
        them: for M-RoPE the planes t, row, column, z of mtmd_image_tokens_get_decoder_pos), with the logits of
        its last embedding, which the helper never asks for: the row after an image that ends a pass (a
        Qwen-VL prompt that stops at its marker). 0, or the failing call's code."""
        L, mtmd = self.L, self.mtmd
        rc: int = mtmd.mtmd_encode_chunk(self.mctx, chunk)
        if rc != 0:
            return rc
        embd = ctypes.cast(mtmd.mtmd_get_output_embd(self.mctx), ctypes.c_void_p).value
        if embd is None:  # no embeddings came out of the encoder
            return -1
        n = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        width = int(L.llama_model_n_embd_inp(L.llama_get_model(ctx))) * ctypes.sizeof(ctypes.c_float)
        planes = 4 if self.mrope else 1
        pos = [[n_past + i for i in range(n)]]  # [planes][n]
        if self.mrope:
            tokens = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
            at = [mtmd.mtmd_image_tokens_get_decoder_pos(tokens, n_past, i) for i in range(n)]
            pos = [[p.t for p in at], [p.y for p in at], [p.x for p in at], [p.z for p in at]]
        non_causal = mtmd.mtmd_decode_use_non_causal(self.mctx, chunk)
        if non_causal:
            L.llama_set_causal_attn(ctx, False)
        try:
            for a in range(0, n, n_batch):
                m = min(n_batch, n - a)
                seq = (L.llama_seq_id * 1)(seq_id)
                batch = L.llama_batch(
                    n_tokens=m,
                    embd=ctypes.cast(embd + a * width, ctypes.POINTER(ctypes.c_float)),
                    pos=(L.llama_pos * (planes * m))(*[p for plane in pos for p in plane[a : a + m]]),  # by plane
                    n_seq_id=(ctypes.c_int32 * m)(*([1] * m)),
                    seq_id=(ctypes.POINTER(L.llama_seq_id) * m)(*([seq] * m)),
                    logits=(ctypes.c_int8 * m)(*([0] * (m - 1) + [int(a + m == n)])),
                )
                rc = int(L.llama_decode(ctx, batch))
                if rc != 0:
                    return rc
        finally:
            if non_causal:
                L.llama_set_causal_attn(ctx, True)
        return 0

    def _tokenized(self, image: PromptImage) -> _Tokenized:
        """The image alone tokenized, from the cache or made now."""
        return self.images.get(image)

    def _free(self, entry: _Tokenized) -> None:
        self.mtmd.mtmd_input_chunks_free(entry.chunks)

    def _entry(self, image: PromptImage) -> _Tokenized:
        mtmd = self.mtmd
        chunks = self._tokenize(image)
        try:
            parts = self._parts(chunks)
        except ValueError:
            mtmd.mtmd_input_chunks_free(chunks)
            raise
        positions = sum(int(mtmd.mtmd_input_chunk_get_n_pos(c)) for c in parts)
        cells = sum(int(mtmd.mtmd_input_chunk_get_n_tokens(c)) for c in parts)
        return _Tokenized(chunks, parts, positions, cells, image_data(image))

    def _parts(self, chunks: Any) -> list[Any]:
        """The chunks that stand for the marker: all of libmtmd's layout, or (WRAPPED) the image chunks inside
        the text libmtmd wraps them in, which the prompt holds around the marker itself."""
        mtmd = self.mtmd
        parts = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
        if self.wrappers is None:
            return parts
        media = [i for i, c in enumerate(parts) if mtmd.mtmd_input_chunk_get_type(c) != _TEXT]
        if not media:
            raise ValueError("libmtmd made no image chunk for the image")
        around = (self._text(parts[: media[0]]), self._text(parts[media[-1] + 1 :]))
        if around != self.wrappers:
            raise ValueError(
                f"libmtmd wraps an image in {around[0]!r} ... {around[1]!r}; the prompt's marker is written "
                f"inside {self.wrappers[0]!r} ... {self.wrappers[1]!r}: a projector of another layout"
            )
        return parts[media[0] : media[-1] + 1]

    def _text(self, chunks: list[Any]) -> str:
        """The text of libmtmd's text chunks, as the vocabulary spells their tokens."""
        out = []
        for chunk in chunks:
            n = ctypes.c_size_t(0)
            tokens = self.mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            out += [self.L.llama_vocab_get_text(self.vocab, tokens[i]).decode(errors="replace") for i in range(n.value)]
        return "".join(out)

    def _tokenize(self, image: PromptImage) -> Any:
        mtmd = self.mtmd
        data = image_data(image)
        width, height = check_header(data)  # ImageError (a ValueError) over the limits: nothing is decoded
        if image.format == "png":
            check_png_data(data)  # stb inflates all the image data there is, whatever the header says
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        opt = mtmd.mtmd_helper_init_opt_default()
        opt.video_params.ffmpeg_bin_dir = NO_FFMPEG  # never a video (ffmpeg) for bytes that are no image
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.mctx, buf, len(data), False, opt)
        if not bitmap:
            raise ValueError(
                f"image {image.sha256[:12]} ({len(data)} bytes, {image.format or 'neither JPEG nor PNG'}) "
                "could not be decoded: corrupt or truncated bytes?"
            )
        size = (mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap))
        if size != (width, height):
            mtmd.mtmd_bitmap_free(bitmap)
            raise ImageError(
                f"image {image.sha256[:12]} decoded to {size[0]} x {size[1]} pixels, its header says "
                f"{width} x {height}: refused"
            )
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            mtmd.mtmd_bitmap_set_id(bitmap, image.sha256.encode())
            text = mtmd.mtmd_input_text(self.marker, len(self.marker), False, True)  # no BOS: the marker alone
            rc = mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
        finally:
            mtmd.mtmd_bitmap_free(bitmap)
        if rc != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            raise ValueError(f"libmtmd could not tile image {image.sha256[:12]} (mtmd_tokenize returned {rc})")
        return chunks

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self.images.clear()
        if self.mctx:
            self.mtmd.mtmd_free(self.mctx)
            self.mctx = None

    def __enter__(self) -> "MtmdVision":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quiet(mtmd: ModuleType) -> None:
    """libmtmd logs every tile it encodes; send its log where llama.cpp's goes (errors only unless verbose)."""
    import llama_cpp._logger

    mtmd.mtmd_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    mtmd.mtmd_helper_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


# --------------------------------------------------------------------------- the projector file

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str | Path, keys: set[str]) -> dict[str, Any]:
    """The scalar and string values of `keys` in a GGUF file's header (stops once all are read)."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            raw = f.read(size)
            if len(raw) != size:
                raise ValueError(f"{path} ends inside its GGUF header")
            return struct.unpack("<" + fmt, raw)[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def value(kind: int) -> Any:
            if kind in _SCALARS:
                return read(_SCALARS[kind])
            if kind == _STRING:
                return string().decode(errors="replace")
            if kind == _ARRAY:
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
                else:
                    for _ in range(count):
                        value(item)
                return None
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        if read("I") < 2:
            raise ValueError(f"{path} is a GGUF of version 1, which llama.cpp no longer reads")
        _n_tensors, n_kv = read("Q"), read("Q")
        for _ in range(n_kv):
            key = string().decode(errors="replace")
            v = value(read("I"))
            if key in keys:
                out[key] = v
                if len(out) == len(keys):
                    break
    return out


def check_mmproj(path: Path, n_embd: int) -> None:
    """Raise ValueError saying why `path` is not a vision projector for a model of width n_embd."""
    if not path.is_file():
        raise ValueError(f"no projector file at {path}")
    meta = gguf_metadata(
        path, {"general.architecture", "clip.has_vision_encoder", "clip.projector_type", "clip.vision.projection_dim"}
    )
    arch = meta.get("general.architecture")
    if arch != "clip":
        raise ValueError(
            f"{path} is not an mmproj (a vision projector): its general.architecture is {arch!r}, "
            "not 'clip'; pass the model's -mmproj GGUF"
        )
    if not meta.get("clip.has_vision_encoder", False):
        raise ValueError(f"{path} has no vision encoder")
    # Idefics3's converter writes the text model's width here; other projectors (LLaVA's) their own
    dim = meta.get("clip.vision.projection_dim")
    if meta.get("clip.projector_type") in PROJECTION_IS_TEXT_WIDTH and dim is not None and dim != n_embd:
        raise ValueError(
            f"{path} projects images to width {dim}, the model's embeddings are {n_embd} wide: "
            "it is another model's mmproj"
        )
