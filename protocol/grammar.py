"""Constrained decoding, identical on both sides: llama.cpp's own GBNF grammar over a model's vocabulary.

The robot (draft, offline generation) and the server (target) each build a
`Grammar` from the same GBNF text over their own GGUF's vocabulary (the
handshake has already checked that the two vocabularies are the same), and walk
it through the same token ids. Both ask llama.cpp's grammar sampler
(`llama_sampler_init_grammar`, the engine behind llama-server's `grammar`) which
tokens may come next, so both sides see the same mask at every position
(tests/protocol/test_grammar.py checks it on recorded answers).

Verification stays exact because the server applies the mask to the target:
p'(x) = p(x) 1[x allowed] / sum_y p(y) 1[y allowed] (temperature and top-k
after the mask). Speculative sampling is exact for any proposal q, so the
draft's own masking only raises acceptance; a drafted token the grammar forbids
simply has p'(x) = 0 and is rejected.

llama.cpp aborts the process when a token the grammar forbids is accepted, so
`GrammarState.accept` checks first and raises `GrammarError` instead.

The only module of `protocol/` that reaches beyond numpy: llama-cpp-python, which
both sides run already (the draft on the robot, the default engine on the server),
imported when a grammar is first built.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # typing only: llama_cpp is imported when a grammar is first built
    from llama_cpp import llama_model_p, llama_sampler_p, llama_vocab_p

TokenIds = Sequence[int] | np.ndarray  # [n] token ids, a list or an int array

MAX_GBNF_BYTES = 16 * 1024  # a grammar on the wire: at most this much GBNF text
MAX_COMPILED = 16  # grammars compiled per vocabulary, least recently used out
# llama_token_data {int32 id; float logit; float p}: 12 bytes, no padding
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it forbids."""


class Grammar:
    """One compiled GBNF grammar over one vocabulary. `start()` gives a state at its root.

    `vocab` is a llama_vocab pointer (llama_model_get_vocab) whose model outlives this object
    (`owner` is kept to make sure).
    """

    def __init__(
        self, gbnf: str, vocab: llama_vocab_p | None, n_vocab: int, owner: object = None, root: str = "root"
    ) -> None:
        import llama_cpp as L

        if not isinstance(gbnf, str) or not gbnf.strip():
            raise GrammarError("the grammar is empty")
        if not vocab:
            raise GrammarError("no vocabulary to compile the grammar over (a null llama_vocab pointer)")
        if len(gbnf.encode("utf-8")) > MAX_GBNF_BYTES:
            raise GrammarError(f"the grammar is {len(gbnf.encode('utf-8'))} bytes; at most {MAX_GBNF_BYTES}")
        self.L = L
        self.gbnf = gbnf
        self.digest = digest(gbnf)
        self.n_vocab = n_vocab
        self._owner = owner
        self._root = L.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
        if not self._root:
            raise GrammarError(f"llama.cpp could not parse the grammar (GBNF, root {root!r})")
        self._all = _token_table(np.arange(n_vocab, dtype=np.int32))  # every token, for whole masks

    def start(self) -> GrammarState:
        return GrammarState(self, self.L.llama_sampler_clone(self._root))

    def walk(self, ids: TokenIds) -> GrammarState:
        """The state after `ids` from the root; GrammarError at the first id it forbids."""
        state = self.start()
        n = state.advance(ids)
        if n < len(ids):
            raise GrammarError(
                f"token {int(ids[n])} at position {n} of the constrained part is not allowed by the grammar"
            )
        return state

    def __del__(self) -> None:
        if getattr(self, "_root", None):
            self.L.llama_sampler_free(self._root)
            del self._root  # freed: a second call finds nothing to free


class GrammarState:
    """Where a generation stands in its grammar. Not thread-safe; `clone()` for a branch."""

    def __init__(self, grammar: Grammar, sampler: llama_sampler_p) -> None:
        self.grammar = grammar
        self._smpl = sampler
        self.n_accepted = 0

    def clone(self) -> GrammarState:
        other = GrammarState(self.grammar, self.grammar.L.llama_sampler_clone(self._smpl))
        other.n_accepted = self.n_accepted
        return other

    def _apply(self, table: np.ndarray) -> np.ndarray:
        """llama.cpp's grammar sampler over `table` (TOKEN_DATA rows): True where allowed."""
        L = self.grammar.L
        table["logit"] = 0.0
        cur = L.llama_token_data_array(
            data=table.ctypes.data_as(L.llama_token_data_p), size=len(table), selected=-1, sorted=False
        )
        L.llama_sampler_apply(self._smpl, ctypes.byref(cur))
        return np.isfinite(table["logit"])

    def mask(self) -> np.ndarray:
        """[vocab] bool: the tokens that may come next."""
        return self._apply(self.grammar._all)

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.grammar.n_vocab:
            return False
        return bool(self._apply(_token_table(np.array([token], dtype=np.int32)))[0])

    def argmax(self, logits: np.ndarray) -> int:
        """The highest-scoring allowed token of logits [vocab] (the masked greedy choice).

        Checks candidates best first, a few at a time, so the usual case (the best token is
        allowed) costs one check instead of a whole-vocabulary mask. Ties go to the lowest id,
        as np.argmax does.
        """
        best = int(np.argmax(logits))
        if self.allows(best):
            return best
        order = np.argsort(-np.asarray(logits, dtype=np.float64), kind="stable")  # ties: lowest id first
        start = 1
        for size in (31, 992, len(order)):
            ids = order[start : start + size].astype(np.int32)
            if not len(ids):
                break
            ok = self._apply(_token_table(ids))
            if ok.any():
                return int(ids[int(np.argmax(ok))])
            start += size
        raise GrammarError("the grammar allows no token here")

    def accept(self, token: int) -> None:
        """Advance past `token`; GrammarError (state unchanged) if the grammar forbids it."""
        if self.advance([token]) == 0:
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def advance(self, ids: TokenIds) -> int:
        """Advance past the ids the grammar allows in a row; returns how many (it stops at the first one
        forbidden, which llama.cpp would abort the process on)."""
        for n, t in enumerate(ids):
            if not self.allows(int(t)):
                return n
            self.grammar.L.llama_sampler_accept(self._smpl, int(t))
            self.n_accepted += 1
        return len(ids)

    def __del__(self) -> None:
        if getattr(self, "_smpl", None):
            self.grammar.L.llama_sampler_free(self._smpl)
            del self._smpl  # freed: a second call finds nothing to free


def _token_table(ids: np.ndarray) -> np.ndarray:
    table = np.zeros(len(ids), TOKEN_DATA)
    table["id"] = ids
    return table


def digest(gbnf: str) -> str:
    return hashlib.sha256(gbnf.encode("utf-8")).hexdigest()[:16]


class GrammarCache:
    """Compiled grammars of one vocabulary by their text; bounded (MAX_COMPILED, least recently used out)."""

    def __init__(
        self, vocab: llama_vocab_p | None, n_vocab: int, owner: object = None, size: int = MAX_COMPILED
    ) -> None:
        self.vocab, self.n_vocab, self.owner, self.size = vocab, n_vocab, owner, size
        self._compiled: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, gbnf: str) -> Grammar:
        key = digest(gbnf) if isinstance(gbnf, str) else ""
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None and grammar.gbnf == gbnf:
                self._compiled.move_to_end(key)
                return grammar
        grammar = Grammar(gbnf, self.vocab, self.n_vocab, self.owner)
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return grammar


def vocab_only(path: str | os.PathLike[str]) -> tuple[llama_model_p, llama_vocab_p, int]:
    """(model, vocab, n_vocab) of a GGUF loaded for its vocabulary alone (no weights): a grammar's
    vocabulary where the model itself runs elsewhere (the torch engine). Free with
    llama_model_free(model) (or keep it for the process)."""
    import llama_cpp as L

    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise GrammarError(f"llama.cpp could not read the vocabulary of {path}")
    vocab = L.llama_model_get_vocab(model)
    if not vocab:
        raise GrammarError(f"llama.cpp gave no vocabulary for {path}")
    return model, vocab, int(L.llama_vocab_n_tokens(vocab))
