"""The typed refusals of structured output, and a GGUF's vocabulary without its weights.

Structured output is LLGuidance's on both sides (protocol/structured.py). What remains here is what that module
and its callers share: `GrammarError` (a grammar that does not compile, or a token it forbids) and its
`SchemaError` (a JSON schema refused, naming the keyword), which the server answers as the wire's bad_field and
the endpoint as a 400; and `vocab_only`, the vocabulary of a GGUF whose model runs elsewhere (the torch engine).

llama.cpp's own GBNF sampler and JSON-schema converter, which both sides ran before (4-11 ms a mask), are gone;
docs/benchmarks/schemas.md keeps what they measured against LLGuidance.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing only: llama_cpp is imported when a vocabulary is first read
    from llama_cpp import llama_model_p, llama_vocab_p


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it forbids."""


class SchemaError(GrammarError):
    """A JSON schema this project will not enforce; `keyword` names the schema keyword at fault and `where` the
    sub-schema (a JSON pointer, "" for the root)."""

    def __init__(self, message: str, keyword: str | None = None, where: str = "") -> None:
        super().__init__(f"{message} (at {where or '/'})" if where else message)
        self.keyword, self.where = keyword, where

    @classmethod
    def restored(cls, text: str, keyword: str | None, where: str) -> SchemaError:
        """The error as another process raised it (`text` is its str(), place included)."""
        e = cls(text, keyword)
        e.where = where
        return e


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
