"""The llamacpp engine on the Qwen-VL family (M-RoPE): an image advances a sequence by its positions, not its tokens.

On each family's tiny random model (tests/models/qwen_vlm.py: its f32 GGUF + mmproj by llama.cpp's own converter)
a 96 x 128 image is 48 tokens (KV cells) and 8 positions (libmtmd's n_pos, max(rows, cols) of its 6 x 8
embeddings). The engine must compute what libmtmd computes on its own for the whole prompt, place the text
after an image at the position after the image's last, verify a tail as one forward of prompt + tail would,
cut by position (after the image, right after it, before it) and re-verify exactly, and batch many robots'
verify passes after their images as it batches text. Every comparison here fails if an image advanced the
position by its token count (the logits after the image move by ~4, and a cut by token count leaves cells
behind that the next pass may not overlap).
"""

import ctypes

import numpy as np
import pytest

from protocol.images import PromptImage
from server_bridge.engines import Pass, load_engine
from tests.models import qwen_vlm as qv
from tests.server_bridge.engines.vision_setup import image_bytes, open_images, prompt_images

pytestmark = pytest.mark.real

TAIL = "A red box on the floor"
SIZES = {0: (96, 128), 1: (64, 64)}  # seed -> (height, width): 48 tokens / 8 positions, 16 / 4


@pytest.fixture(scope="module", params=qv.FAMILIES)
def vlm(request, qwen_vlm):
    return qwen_vlm(request.param)  # made once per run (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(vlm):
    return load_engine(
        str(vlm.target), engine="llamacpp", threads=1, max_sequences=8, kv_tokens=2048, mmproj=vlm.target_mmproj
    )


def pixels(seed: int) -> np.ndarray:
    return qv.random_image(seed, *SIZES[seed])


def encoded(seed: int) -> bytes:
    return image_bytes(pixels(seed))  # PNG, lossless: libmtmd sees these pixels


def prompt(engine, seeds=(0,), text: str = qv.PROMPT) -> tuple[list[int], dict[int, PromptImage]]:
    """The prompt's ids and its images on their <|image_pad|> markers, in order."""
    return prompt_images(engine, [encoded(s) for s in seeds], text)


def libmtmd(vlm, text: str, seeds=(0,)) -> tuple[np.ndarray, int]:
    """libmtmd's own evaluation of `text` with its images (each IMAGE_SPAN: libmtmd writes <|vision_start|> and
    <|vision_end|> itself): ([vocab] logits after it, the next position)."""
    import llama_cpp as L
    import llama_cpp.mtmd_cpp as mtmd

    model = L.llama_model_load_from_file(str(vlm.target).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 1024, 1024, 1, 1
    ctx = L.llama_init_from_model(model, cp)
    mp = mtmd.mtmd_context_params_default()
    mp.use_gpu, mp.n_threads, mp.print_timings, mp.warmup = False, 1, False, False
    mctx = mtmd.mtmd_init_from_file(str(vlm.target_mmproj).encode(), model, mp)
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = []
    for s in seeds:
        img = np.ascontiguousarray(pixels(s))
        bitmaps.append(
            mtmd.mtmd_bitmap_init(img.shape[1], img.shape[0], (ctypes.c_uint8 * img.size).from_buffer_copy(img))
        )
    try:
        raw = text.replace(qv.IMAGE_SPAN, mtmd.mtmd_default_marker().decode()).encode()
        inp = mtmd.mtmd_input_text(raw, len(raw), False, True)
        assert (
            mtmd.mtmd_tokenize(
                mctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * len(seeds))(*bitmaps), len(seeds)
            )
            == 0
        )
        n_past = L.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 1024, True, ctypes.byref(n_past)) == 0
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy(), n_past.value
    finally:
        for b in bitmaps:
            mtmd.mtmd_bitmap_free(b)
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(model)


def open_with(engine, seeds=(0,), text: str = qv.PROMPT):
    """A new sequence holding the prompt: (sequence, ids, images, [vocab] logits after the prompt)."""
    return open_images(engine, [encoded(s) for s in seeds], text)


def test_an_image_takes_its_positions_and_the_logits_are_libmtmds(vlm, engine):
    assert engine.vision.mrope and engine.image_token_id == vlm.image_token_id
    seq, ids, images, row = open_with(engine)
    image = images[ids.index(vlm.image_token_id)]
    # 96 x 128 pixels: 6 x 8 embeddings (16-pixel cells), 48 KV cells, 8 positions (the longer side)
    assert engine.image_positions(image) == 8 and engine.vision.cells(image) == 48
    ref, n_past = libmtmd(vlm, qv.PROMPT)
    assert engine.kv_pos(seq, len(ids)) == n_past == len(ids) + 7
    assert seq.length == len(ids) and engine.kv_used == len(ids) + 47
    assert np.abs(row - ref).max() < 1e-4
    engine.free(seq)


def test_a_verify_pass_after_the_image_is_one_forward_of_prompt_and_tail(vlm, engine):
    seq, ids, images, _ = open_with(engine)
    more = engine.tokenizer.encode(qv.PROMPT + TAIL)
    assert more[: len(ids)] == ids
    tail = more[len(ids) :]
    [verify] = engine.forward([Pass(seq, len(ids), tail, len(tail))])  # [k, vocab]: one pass, as a round's
    whole = engine.new_sequence()
    [once] = engine.forward([Pass(whole, 0, more, len(tail) + 1, images=images)])
    assert np.abs(verify - once[1:]).max() < 1e-3
    ref, n_past = libmtmd(vlm, qv.PROMPT + TAIL)
    assert np.abs(verify[-1] - ref).max() < 1e-3 and engine.kv_pos(seq, len(more)) == n_past
    for s in (seq, whole):
        engine.free(s)


def test_cuts_after_right_after_and_before_the_image_go_by_position(engine):
    """A rejection's rollback anywhere around the image, then the pass again: the logits of a fresh sequence.

    A cut by token count would leave the cells past the cut's position in place, and M-RoPE refuses a
    pass that does not start after every position the sequence holds."""
    seq, ids, images, row = open_with(engine)
    at = next(iter(images))
    tail = engine.tokenizer.encode(qv.PROMPT + TAIL)[len(ids) :]
    [first] = engine.forward([Pass(seq, len(ids), tail, len(tail))])
    wrong = [(t + 1) % engine.vocab_size for t in tail]
    engine.forward([Pass(seq, len(ids), wrong, len(wrong))])  # a rejected draft in the KV
    engine.truncate(seq, len(ids))  # after the prompt: its image stays
    assert engine.kv_used == len(ids) + 47
    [again] = engine.forward([Pass(seq, len(ids), tail, len(tail))])
    assert np.abs(again - first).max() < 1e-4
    engine.truncate(seq, at + 1)  # right after the image: the next id is <|vision_end|>
    assert engine.kv_pos(seq, at + 1) == at + 8 and engine.kv_used == at + 48
    [rows] = engine.forward([Pass(seq, at + 1, ids[at + 1 :] + tail, len(tail) + 1)])
    assert np.abs(rows[0] - row).max() < 1e-4 and np.abs(rows[1:] - first).max() < 1e-3
    engine.truncate(seq, at)  # before it: all its cells go
    assert seq.length == at and engine.kv_used == at
    [rows] = engine.forward([Pass(seq, at, ids[at:], 1, images={0: images[at]})])
    assert np.abs(rows[0] - row).max() < 1e-4
    engine.free(seq)
    fresh = engine.new_sequence()
    engine.forward([Pass(fresh, 0, [11, 12], 1)])  # its cells went back
    assert engine.kv_used == 2
    engine.free(fresh)


def test_a_pass_that_ends_on_the_image_gives_the_row_after_it(vlm, engine):
    """libmtmd's helper asks no logits of an image's embeddings: a prompt that stops at its <|image_pad|> gets
    the row after the image from the engine's own decode of it, at libmtmd's positions (Hugging Face's logits
    there, to the f32 GGUF's own distance from them), and leaves the KV libmtmd's helper would."""
    seq, ids, images = engine.new_sequence(), *prompt(engine)
    at = next(iter(images))
    [head] = engine.forward([Pass(seq, 0, ids[: at + 1], 1, images=images)])
    [rest] = engine.forward([Pass(seq, at + 1, ids[at + 1 :], 1)])
    assert np.abs(rest[0] - libmtmd(vlm, qv.PROMPT)[0]).max() < 1e-4
    stop = qv.PROMPT[: qv.PROMPT.index(qv.IMAGE_TOKEN) + len(qv.IMAGE_TOKEN)]
    hf = np.asarray(qv.hf_run(vlm.hf_dir, pixels(0), prompt=stop, n=1).logits)
    assert np.abs(head[0] - hf).max() < 0.05  # f32 GGUF against Hugging Face: 0.01-0.03 here
    engine.free(seq)


def test_two_images_in_one_prompt_add_their_positions(vlm, engine):
    text = qv.PROMPT.replace(qv.IMAGE_SPAN, qv.IMAGE_SPAN + "and" + qv.IMAGE_SPAN)
    seq, ids, images, row = open_with(engine, (0, 1), text)
    second = sorted(images)[1]
    assert engine.kv_pos(seq, second) == second + 7 and engine.kv_pos(seq, len(ids)) == len(ids) + 7 + 3
    assert engine.kv_used == len(ids) + 47 + 15
    ref, n_past = libmtmd(vlm, text, (0, 1))
    assert engine.kv_pos(seq, len(ids)) == n_past and np.abs(row - ref).max() < 1e-4
    engine.truncate(seq, second + 1)  # between the images' positions and the text after the second
    [rows] = engine.forward([Pass(seq, second + 1, ids[second + 1 :], 1)])
    assert np.abs(rows[0] - row).max() < 1e-4
    engine.free(seq)


def test_robots_with_images_verify_in_one_batched_pass(engine):
    """After each robot's prefill, one pass over every robot's draft (two images, one text prompt): each robot's
    rows are its own pass's, and two images give two outputs."""
    text = engine.tokenizer.encode("The robot walked to the kitchen door and")
    seqs, alone, tails = [], [], []
    for seeds in ((0,), (1,)):
        seq, ids, _, row = open_with(engine, seeds)
        tail = [int(row.argmax()), 7, 9]
        [rows] = engine.forward([Pass(seq, len(ids), tail, 3)])
        engine.truncate(seq, len(ids))
        seqs.append((seq, len(ids)))
        alone.append(rows)
        tails.append(tail)
    plain = engine.new_sequence()
    [ref_text] = engine.forward([Pass(plain, 0, text, 2)])
    engine.truncate(plain, len(text) - 2)
    passes = [Pass(s, n, t, 3) for (s, n), t in zip(seqs, tails, strict=True)] + [
        Pass(plain, len(text) - 2, text[-2:], 2)
    ]
    batched = engine.forward(passes)
    assert np.abs(batched[0] - alone[0]).max() < 1e-3 and np.abs(batched[1] - alone[1]).max() < 1e-3
    assert np.abs(batched[2] - ref_text).max() < 1e-3
    assert np.abs(alone[0][0] - alone[1][0]).max() > 1e-2  # the image reached the model
    for s, _ in seqs:
        engine.free(s)
    engine.free(plain)


def test_a_projector_that_wraps_images_otherwise_is_refused_with_the_reason(vlm, engine):
    """The prompt holds <|vision_start|> and <|vision_end|> around the marker; libmtmd's own wrappers must be those."""
    from runtime.vision import MtmdVision

    with MtmdVision(vlm.target_mmproj, engine.model) as vision:
        assert vision.wrappers == ("<|vision_start|>", "<|vision_end|>")
        vision.wrappers = ("<|im_start|>", "<|vision_end|>")
        with pytest.raises(ValueError, match="another layout"):
            vision.positions(PromptImage.of(encoded(1), 0))
