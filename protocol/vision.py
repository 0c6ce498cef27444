"""A prompt's images into a llama.cpp sequence, through libmtmd (llama.cpp's multimodal library).

    vision = MtmdVision("target-mmproj.gguf", model)    # the projector for a loaded llama_model
    n = vision.positions(image)                          # KV positions the image's one marker expands to
    vision.eval(ctx, seq_id, n_past, image, n_batch)     # writes them at n_past..n_past+n-1 of seq_id
    image = vision.resolve(image)                        # its bytes from the cache when only the sha256 came
    vision.prepare(image)                                # decode and tile now, in this thread (not the model's)

A prompt holds one image marker token per image (protocol/images.py); libmtmd expands one marker to
the model's whole layout for that image. For SmolVLM (Idefics3) that is more than the image
embeddings: each 64 x 64 tile (the test VLM's size) is wrapped in its own text tokens,
`<fake_token_around_image><row_R_col_C>` + 4 embeddings, rows end in "\n", and the overview follows
as `<fake_token_around_image><global-img>` + 4 embeddings + `<fake_token_around_image>`: a square
image on the test VLM takes 33 positions (20 embeddings, 13 text tokens). Both sides tokenize the text
around a marker on their own; only what stands for the marker comes from here.

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
from dataclasses import replace
from pathlib import Path

from .images import ImageError, PromptImage, check_header, check_png_data

CACHED = 8  # tokenized images kept by sha256 (their preprocessed tiles, their bytes)
READY = 8  # images tokenized ahead by `prepare`, not yet taken by the model thread (beyond: the oldest is dropped,
# and tokenized again when its open runs)
NO_FFMPEG = b"/dev/null"  # where libmtmd looks for ffmpeg for bytes stb_image cannot decode: nothing is found there
MARKERS = ("<image>",)  # the image marker tokens this reads (SmolVLM's); one id per image
PROJECTION_IS_TEXT_WIDTH = {"idefics3"}  # projector types whose clip.vision.projection_dim is the text width


class UnknownImage(LookupError):
    """Only the image's sha256 came, and its bytes are no longer cached (the wire's `unknown_image`)."""


def marker_id(vocab) -> int | None:
    """The id of the model's image marker (SmolVLM's `<image>`) in a llama.cpp vocabulary; None if it has none."""
    import llama_cpp as L

    for text in MARKERS:
        raw = text.encode()
        buf = (L.llama_token * 8)()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, True)  # parse_special: one id
        if n == 1 and L.llama_vocab_get_text(vocab, buf[0]) == raw:
            return int(buf[0])
    return None


class MtmdVision:
    """libmtmd's projector for one llama_model: image -> positions, image -> prefilled KV."""

    def __init__(self, mmproj_path: str | Path, llama_model, threads: int = 1, use_gpu: bool = False):
        import llama_cpp as L
        import llama_cpp.mtmd_cpp as mtmd

        self.L, self.mtmd = L, mtmd
        self.path = Path(mmproj_path)
        self.mctx = None
        self._cache: OrderedDict[str, tuple[object, int, bytes]] = OrderedDict()  # sha256 -> (chunks, positions, bytes)
        self._ready: OrderedDict[str, tuple[object, int, bytes]] = OrderedDict()  # the same, made by `prepare`
        self._ready_lock = threading.Lock()
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
        if mtmd.mtmd_decode_use_mrope(self.mctx):
            self.close()
            raise ValueError(
                f"{self.path} is for an M-RoPE model (Qwen2-VL-like): its image positions are 2-D, "
                "and this engine places tokens at 1-D positions"
            )
        self.threads = threads
        self.marker = mtmd.mtmd_default_marker()

    # ------------------------------------------------------------------ images

    def positions(self, image: PromptImage) -> int:
        """KV positions the image's marker expands to (text tokens around the tiles included).

        Raises ValueError for bytes that are no image, UnknownImage for a hash no longer cached."""
        return self._tokenized(image)[1]

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes: as it came, or filled in from the cache; UnknownImage if not cached."""
        if image.data is not None:
            return image
        return replace(image, data=self._tokenized(image)[2])

    def prepare(self, image: PromptImage) -> None:
        """Decode and tile the image now, in the calling thread, so that the model thread finds it ready.

        Thread-safe; raises ValueError for bytes that are no image (ImageError for an image over the limits,
        before anything is decoded). An image that came as its hash alone is left to the model thread."""
        if image.data is None or image.sha256 in self._cache:
            return
        with self._ready_lock:
            if image.sha256 in self._ready:
                return
        entry = self._entry(image)
        with self._ready_lock:
            if image.sha256 in self._ready:  # made meanwhile by another thread
                self.mtmd.mtmd_input_chunks_free(entry[0])
                return
            self._ready[image.sha256] = entry
            while len(self._ready) > READY:
                self.mtmd.mtmd_input_chunks_free(self._ready.popitem(last=False)[1][0])

    def eval(self, ctx, seq_id: int, n_past: int, image: PromptImage, n_batch: int, logits_last: bool = False) -> int:
        """Encode the image and decode its positions into seq_id at n_past, n_past + 1, ...; the positions used.

        logits_last: the context's last logits row is the one after the image's last position.
        On failure the KV past n_past may hold part of the image: the caller cuts it back."""
        chunks, n, _ = self._tokenized(image)
        new_n_past = self.L.llama_pos(n_past)
        rc = self.mtmd.mtmd_helper_eval_chunks(
            self.mctx, ctx, chunks, n_past, seq_id, n_batch, logits_last, ctypes.byref(new_n_past)
        )
        if rc != 0:
            raise RuntimeError(
                f"libmtmd could not evaluate image {image.sha256[:12]} at position {n_past} "
                f"(mtmd_helper_eval_chunks returned {rc})"
            )
        if new_n_past.value - n_past != n:
            raise RuntimeError(
                f"image {image.sha256[:12]} took {new_n_past.value - n_past} positions, its chunks say {n}"
            )
        return n

    def _tokenized(self, image: PromptImage) -> tuple[object, int, bytes]:
        """(mtmd_input_chunks, positions, bytes) of the image alone, from the cache or made now."""
        hit = self._cache.get(image.sha256)
        if hit is not None:
            self._cache.move_to_end(image.sha256)
            return hit
        with self._ready_lock:
            entry = self._ready.pop(image.sha256, None)
        if entry is None:
            if image.data is None:
                raise UnknownImage(
                    f"image {image.sha256[:12]} came as its sha256 alone and is not cached: send its bytes again"
                )
            entry = self._entry(image)  # not prepared ahead (a direct caller), or dropped from READY
        self._cache[image.sha256] = entry
        while len(self._cache) > CACHED:
            self.mtmd.mtmd_input_chunks_free(self._cache.popitem(last=False)[1][0])
        return entry

    def _entry(self, image: PromptImage) -> tuple[object, int, bytes]:
        chunks = self._tokenize(image)
        return chunks, int(self.mtmd.mtmd_helper_get_n_pos(chunks)), bytes(image.data)

    def _tokenize(self, image: PromptImage):
        mtmd = self.mtmd
        data = bytes(image.data)
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
        while self._cache:
            self.mtmd.mtmd_input_chunks_free(self._cache.popitem()[1][0])
        with self._ready_lock:
            while self._ready:
                self.mtmd.mtmd_input_chunks_free(self._ready.popitem()[1][0])
        if self.mctx:
            self.mtmd.mtmd_free(self.mctx)
            self.mctx = None

    def __enter__(self) -> "MtmdVision":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _quiet(mtmd) -> None:
    """libmtmd logs every tile it encodes; send its log where llama.cpp's goes (errors only unless verbose)."""
    import llama_cpp._logger

    mtmd.mtmd_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    mtmd.mtmd_helper_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


# --------------------------------------------------------------------------- the projector file

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str | Path, keys: set[str]) -> dict:
    """The scalar and string values of `keys` in a GGUF file's header (stops once all are read)."""
    out: dict = {}
    with open(path, "rb") as f:

        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            raw = f.read(size)
            if len(raw) != size:
                raise ValueError(f"{path} ends inside its GGUF header")
            return struct.unpack("<" + fmt, raw)[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def value(kind: int):
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
