"""The checks every handler (opens.py, verifier.py, ar.py) makes of a request before any model work, and the
grammar's walk over what a request committed. Beside the verifier rather than in it: verifier.py imports the
open and ar handlers, which need these too."""

from __future__ import annotations

from protocol.wire import WireError

from .sessions import Session


def check_ids(ids: list[int], vocab_size: int, name: str, sid: str | None = None) -> None:
    """bad_field unless every id is inside the agreed vocabulary."""
    if ids and max(ids) >= vocab_size:
        raise WireError("bad_field", f"{name} holds token id {max(ids)} outside the vocabulary of {vocab_size}", sid)


def check_live(session: Session) -> None:
    """Runs in the model thread, like an open, so a re-open and a stale request cannot interleave."""
    if session.retired:
        raise WireError(
            "unknown_session",
            f"session {session.sid!r} was evicted or re-opened elsewhere: re-open it with the committed prefix",
            session.sid,
        )


def advance(session: Session, committed: list[int]) -> None:
    """Walk the session's grammar over newly committed ids. Each was chosen under the grammar's mask
    (a masked argmax, or a token of p' > 0), so the walk cannot fail short of a bug, which then
    surfaces as GrammarError."""
    if session.grammar is not None:
        for t in committed:
            session.grammar.accept(t)
