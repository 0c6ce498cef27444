"""Early-exit adapters for the target (FSD): after chosen layers, a small residual adapter whose
output goes through the target's own final norm and LM head. Base weights stay frozen.

An exit's verdict is a hint for pre-drafting on the robot; only the final
layer decides what is committed, so exits never affect exactness. To keep them
cheap, an exit may score only candidate tokens (for a draft position, the
draft's top-K): one full-vocabulary head over 5 positions costs about as much
as a sixth of the whole verify pass on this CPU (DESIGN.md).

Layer numbering: exit `l` reads the residual stream after decoder block `l`
(1-based), i.e. `hidden_states[l]` of a transformers forward pass.

During a verify pass, `ExitPass` scores the enabled exits from forward hooks
(`TargetModel.score(..., taps=...)`) as the pass goes, and hands each new
verdict to a callback at once, before the final layer has run.

What that costs, per verify pass of a 4-token draft on 1 torch thread (medians
of 40 interleaved runs on the 2-core development machine, shared with other
work at the time; `python -m tools.exit_cost --draft 4 --cands 8 --iters 40`):

  pass without exits                                     96.1 ms
  pass with exits at 12, 18, 22, 26 on K=8 candidates   108.1 ms
    of it in the exits, draft accepted in full (bonus)   11.6 ms
    of it in the exits, draft rejected at row 0           2.8 ms
  the bonus row's 1-row full-vocabulary head              8.5 ms  (once per pass)
  one exit's candidate scoring, 4 rows x 8                0.6 ms
  pass with the same 4 exits on the full vocabulary     178.5 ms  (exits 79.6 ms)

So exits score candidates only; the one full-head row at the bonus position
is most of their cost when the draft is accepted.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class ExitConfig:
    layers: list[int]           # decoder blocks after which an exit sits (1-based)
    hidden: int
    rank: int = 64
    target: str = ""            # which target the adapters were trained for
    info: dict = field(default_factory=dict)   # training provenance and measured agreement

    def __post_init__(self) -> None:
        if not self.layers or sorted(set(self.layers)) != list(self.layers) or self.layers[0] < 1:
            raise ValueError(f"exit layers must be increasing and >= 1, got {self.layers}")
        if self.rank < 1:
            raise ValueError("rank must be >= 1")


class ExitAdapter(nn.Module):
    """h -> h + up(silu(down(h))); `up` starts at zero, so an untrained exit is the plain logit lens."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:       # [..., hidden] -> [..., hidden]
        return h + self.up(F.silu(self.down(h)))


class ExitHeads(nn.Module):
    def __init__(self, config: ExitConfig):
        super().__init__()
        self.config = config
        self.adapters = nn.ModuleDict({str(l): ExitAdapter(config.hidden, config.rank) for l in config.layers})

    @property
    def layers(self) -> list[int]:
        return self.config.layers

    def features(self, model, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head sees at this exit: final_norm(adapter(hidden)), [n, hidden] -> [n, hidden]."""
        return model.model.norm(self.adapters[str(layer)](hidden))

    def logits(self, model, layer: int, hidden: torch.Tensor,
               candidates: torch.Tensor | None = None) -> torch.Tensor:
        """Exit logits at `layer` for hidden [n, hidden].

        candidates None -> [n, vocab]; candidates [n, K] token ids -> [n, K] (only those rows of the head).
        """
        h = self.features(model, layer, hidden)                           # [n, hidden]
        weight = model.lm_head.weight                                     # [vocab, hidden]
        if candidates is None:
            return h @ weight.T
        return torch.einsum("nh,nkh->nk", h, weight[candidates])

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path.with_suffix(".safetensors")))
        path.with_suffix(".json").write_text(json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(cls, path: str | Path, layers: list[int] | None = None) -> "ExitHeads":
        """Load saved adapters; `layers` keeps a subset of them (the robot's --exits)."""
        from safetensors.torch import load_file

        path = Path(path)
        config = ExitConfig(**json.loads(path.with_suffix(".json").read_text()))
        heads = cls(config)
        heads.load_state_dict(load_file(str(path.with_suffix(".safetensors"))))
        if layers is not None:
            missing = set(layers) - set(config.layers)
            if missing:
                raise ValueError(f"no trained exit at layers {sorted(missing)}; available: {config.layers}")
            keep = ExitHeads(ExitConfig(sorted(layers), config.hidden, config.rank, config.target, config.info))
            for l in layers:
                keep.adapters[str(l)].load_state_dict(heads.adapters[str(l)].state_dict())
            heads = keep
        return heads.eval().requires_grad_(False)


# --------------------------------------------------------------------------- verdicts during a verify pass

@dataclass
class ExitVerdict:
    layer: int                  # the exit that decided it
    accepted: int               # draft tokens this exit would keep
    tokens: list[int]           # draft_ids[:accepted] + [this exit's next token]
    confidence: float           # max softmax probability over the candidates of row `accepted`


def candidate_rows(draft_ids: np.ndarray, cands: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidate set of each draft row: cands[i] ∪ {draft[i]}.

    draft_ids [k], cands [k, K] -> ids [k, K + 1] int64 sorted ascending (so an
    argmax tie goes to the smallest id, as over the full vocabulary) and
    dup [k, K + 1] bool, True where an id repeats (scored -inf: a repeat would
    count its probability twice).
    """
    ids = np.sort(np.concatenate([cands.astype(np.int64), draft_ids.astype(np.int64)[:, None]], axis=1), axis=1)
    dup = np.zeros(ids.shape, bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return ids, dup


def first_rejection(draft_ids: np.ndarray, best_ids: np.ndarray) -> int:
    """Greedy acceptance: a = min{i : best[i] != draft[i]}, or k when the exit agrees with every draft token.

    draft_ids [k], best_ids [k] (the exit's argmax at each draft row).
    """
    miss = np.flatnonzero(np.asarray(best_ids) != np.asarray(draft_ids))
    return int(miss[0]) if miss.size else len(draft_ids)


class ExitPass:
    """The enabled exits of one verify pass, scored from forward hooks while the pass runs.

    Row i of the pass (i = 0..k) is the position after draft[:i]. At each exit
    the greedy rule decides: a = first_rejection(draft, argmax of rows 0..k-1),
    next token = the argmax of row a, confidence = its softmax probability.
    Row i < k scores only cands[i] ∪ {draft[i]} (the full vocabulary when the
    robot sent no cands). Row k (the bonus row, reached when every draft token
    is accepted) needs the full head once per pass, at the first exit that
    reaches it; later exits score that row's top `bonus_candidates` ids only.

    The same greedy rule holds at temperature > 0. Verdicts are hints for the
    robot's pre-drafting: the final layer alone decides what is committed, so
    an exit can never change a result. Nor can it stop one: an exception here
    is logged once and the remaining exits of the pass are skipped.
    """

    def __init__(self, heads: ExitHeads, model, layers: list[int], draft_ids: list[int],
                 cands: np.ndarray | None = None, bonus_candidates: int = 16,
                 emit: Callable[[ExitVerdict], None] | None = None):
        self.heads = heads
        self.model = model
        self.layers = list(layers)
        self.draft_ids = list(draft_ids)            # [k]
        self.cands = cands                          # [k, K] int32 or None (full vocabulary)
        self.bonus_candidates = bonus_candidates
        self.emit = emit                            # called with each verdict that differs from the last sent
        self.verdicts: list[ExitVerdict] = []       # every exit that ran, emitted or not, in layer order
        self.ms = 0.0                               # time spent in exit heads (and emit) this pass
        self.failed = False                         # an exit raised: the rest of the pass runs without exits
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None   # candidate ids, dup mask [k, K + 1]
        self._bonus_ids: torch.Tensor | None = None                     # [bonus_candidates] once the full row ran
        self._last_sent: list[int] | None = None

    @property
    def taps(self) -> dict[int, Callable[[torch.Tensor], None]]:
        """layer -> hook body, for `TargetModel.score(..., taps=...)`."""
        return {l: functools.partial(self._tap, l) for l in self.layers}

    @property
    def reached_bonus(self) -> bool:
        """Whether an exit of this pass accepted the whole draft (and paid the bonus row's full head)."""
        return self._bonus_ids is not None

    def agreeing_layer(self, tokens: list[int]) -> int | None:
        """The earliest exit whose verdict equals the final one (tokens = committed this round), if any."""
        return next((v.layer for v in self.verdicts if v.tokens == list(tokens)), None)

    def _tap(self, layer: int, hidden: torch.Tensor) -> None:      # hidden [k + 1, hidden]
        if self.failed:
            return
        t0 = time.perf_counter()
        try:
            verdict = self.score(layer, hidden)
            self.verdicts.append(verdict)
            if verdict.tokens != self._last_sent:
                self._last_sent = verdict.tokens
                if self.emit is not None:
                    self.emit(verdict)
        except Exception:
            self.failed = True
            log.exception("early exit at layer %d failed; exits are skipped for the rest of this pass", layer)
        finally:
            self.ms += (time.perf_counter() - t0) * 1e3

    def score(self, layer: int, hidden: torch.Tensor) -> ExitVerdict:
        """The greedy verdict of exit `layer` on the pass's draft rows, hidden [k + 1, hidden]."""
        k = len(self.draft_ids)
        if hidden.ndim != 2 or hidden.shape[0] != k + 1:
            raise ValueError(f"exit {layer}: expected hidden [k + 1 = {k + 1}, H], got {list(hidden.shape)}")
        accepted = k
        if k:
            ids, dup = self._candidates()                                   # [k, K + 1] each, or None
            logits = self.heads.logits(self.model, layer, hidden[:k], ids)  # [k, K + 1] or [k, vocab]
            if dup is not None:
                logits = logits.masked_fill(dup, -math.inf)
            best = logits.argmax(-1)                                        # [k] column index
            best_ids = best if ids is None else ids.gather(1, best[:, None])[:, 0]
            accepted = first_rejection(np.asarray(self.draft_ids), best_ids.cpu().numpy())
        if accepted < k:
            row_ids, row = (None if ids is None else ids[accepted]), logits[accepted]
        else:
            row_ids, row = self._bonus_row(layer, hidden[k:])
        probs = torch.softmax(row.float(), -1)                                    # over this row's candidates
        j = int(probs.argmax())
        confidence = float(probs[j])
        if not math.isfinite(confidence):
            raise ValueError(f"exit {layer}: non-finite confidence {confidence}")
        token = j if row_ids is None else int(row_ids[j])
        return ExitVerdict(layer, accepted, self.draft_ids[:accepted] + [token], min(1.0, confidence))

    def _candidates(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.cands is None:
            return None, None
        if self._rows is None:
            ids, dup = candidate_rows(np.asarray(self.draft_ids), np.asarray(self.cands))
            dev = self.model.lm_head.weight.device
            self._rows = torch.from_numpy(ids).to(dev), torch.from_numpy(dup).to(dev)
        return self._rows

    def _bonus_row(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(candidate ids or None for all, logits) of the bonus row; hidden [1, hidden]."""
        if self._bonus_ids is None:
            row = self.heads.logits(self.model, layer, hidden)[0]           # [vocab]: once per pass
            top = torch.topk(row, min(self.bonus_candidates, row.shape[0])).indices
            self._bonus_ids = torch.sort(top).values                        # ascending: ties as in the full head
            return None, row
        return self._bonus_ids, self.heads.logits(self.model, layer, hidden, self._bonus_ids[None])[0]
