"""Early exits for FSD: after chosen layers of the target, a small residual adapter whose output goes
through the target's own final norm and LM head. Base weights stay frozen. No torch here.

An exit's verdict is a hint for pre-drafting on the robot; only the final
layer decides what is committed, so exits never affect exactness. To keep them
cheap, an exit may score only candidate tokens (for a draft position, the
draft's top-K): one full-vocabulary head over 5 positions costs about as much
as a sixth of the whole verify pass on this CPU (DESIGN.md).

Layer numbering: exit `l` reads the residual stream after decoder block `l`
(1-based), i.e. `hidden_states[l]` of a transformers forward pass and
`l_out-<l - 1>` of a llama.cpp graph.

The heads come in two forms with one method, `logits(layer, hidden, candidates)`:
- `NumpyExitHeads` (here): for the llamacpp engine, the adapters in numpy and the
  final norm and LM head read from the target's own GGUF (memory-mapped, so the
  pages are the ones llama.cpp already maps);
- `exits_torch.TorchExitScorer`: the trained `nn.Module`s on the torch engine's device.
During a verify pass the engine hands `ExitPass` the exit layers' rows as it
computes them (forward hooks on torch, the eval callback on llama.cpp), and each
new verdict goes to a callback at once, before the final layer has run.

Costs are measured by `python -m tools.bench.exit_cost` (see its docstring and the README).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class ExitConfig:
    layers: list[int]  # decoder blocks after which an exit sits (1-based)
    hidden: int
    rank: int = 64
    target: str = ""  # which target the adapters were trained for
    info: dict = field(default_factory=dict)  # training provenance and measured agreement

    def __post_init__(self) -> None:
        if not self.layers or sorted(set(self.layers)) != list(self.layers) or self.layers[0] < 1:
            raise ValueError(f"exit layers must be increasing and >= 1, got {self.layers}")
        if self.rank < 1:
            raise ValueError("rank must be >= 1")

    @classmethod
    def load(cls, path: str | Path) -> "ExitConfig":
        """The config saved beside the adapters (path with or without its suffix)."""
        return cls(**json.loads(Path(path).with_suffix(".json").read_text()))

    def pick(self, layers: list[int] | None) -> list[int]:
        """The layers to run: all trained ones, or the subset asked for (an error names the missing)."""
        if layers is None:
            return list(self.layers)
        missing = set(layers) - set(self.layers)
        if missing:
            raise ValueError(f"no trained exit at layers {sorted(missing)}; available: {self.layers}")
        return sorted(set(layers))


class ExitScorer(Protocol):
    """What ExitPass needs of the heads: exit logits as numpy float32."""

    layers: list[int]

    def logits(self, layer: int, hidden: Any, candidates: np.ndarray | None = None) -> np.ndarray:
        """hidden [n, H] (the engine's rows) -> [n, vocab], or [n, K] for candidates [n, K] token ids."""
        ...


class NumpyExitHeads:
    """The exit heads in numpy over the target's GGUF: h -> norm(h + up(silu(down(h)))) -> LM head rows.

    The same function as `exits_torch.ExitHeads` (tests/server_bridge/test_exits.py compares them).
    """

    def __init__(
        self,
        config: ExitConfig,
        adapters: dict[int, tuple[np.ndarray, np.ndarray]],
        norm: np.ndarray,
        eps: float,
        head: np.ndarray,
    ):
        self.config = config
        self.layers = sorted(adapters)
        self.adapters = adapters  # layer -> (down [rank, H], up [H, rank]), float32
        self.norm = norm  # [H] the final RMSNorm's weight
        self.eps = eps
        self.head = head  # [vocab, H] the LM head (memory-mapped; tied to the embeddings)

    def features(self, layer: int, hidden: np.ndarray) -> np.ndarray:
        """final_norm(adapter(hidden)): [n, H] -> [n, H] float32."""
        down, up = self.adapters[layer]
        h = np.asarray(hidden, np.float32)
        z = h @ down.T
        h = h + (z * 0.5 * (1.0 + np.tanh(0.5 * z))) @ up.T  # silu, without exp overflow
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + self.eps) * self.norm

    def logits(self, layer: int, hidden: np.ndarray, candidates: np.ndarray | None = None) -> np.ndarray:
        h = self.features(layer, hidden)
        if candidates is None:
            return h @ self.head.T
        return np.einsum("nh,nkh->nk", h, self.head[candidates])

    @classmethod
    def load(cls, path: str | Path, gguf_path: str | Path, layers: list[int] | None = None) -> "NumpyExitHeads":
        """Adapters saved by `server-bridge train-exits`; the final norm and LM head from the target's GGUF."""
        import gguf
        import threadpoolctl
        from safetensors.numpy import load_file

        # The heads run inside llama.cpp's pass, on its thread and cores. OpenBLAS's own threads keep
        # spinning there after a matmul and slow the pass itself (a 1-thread pass on one core went
        # from ~40 to ~116 ms), so numpy's BLAS gets one thread in this process.
        threadpoolctl.threadpool_limits(1, user_api="blas")

        path = Path(path)
        config = ExitConfig.load(path)
        tensors = load_file(str(path.with_suffix(".safetensors")))
        adapters = {
            l: (
                tensors[f"adapters.{l}.down.weight"].astype(np.float32),
                tensors[f"adapters.{l}.up.weight"].astype(np.float32),
            )
            for l in config.pick(layers)
        }
        reader = gguf.GGUFReader(str(gguf_path))
        arch = reader.fields["general.architecture"].contents()
        eps = float(reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())
        weights = {
            t.name: t for t in reader.tensors if t.name in ("output_norm.weight", "output.weight", "token_embd.weight")
        }
        if "output_norm.weight" not in weights:
            raise ValueError(f"{gguf_path} has no output_norm.weight: not a llama-like model")

        def read(name: str) -> np.ndarray:
            t = weights[name]
            if t.tensor_type in (gguf.GGMLQuantizationType.F32,):
                return t.data
            return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

        head = read("output.weight" if "output.weight" in weights else "token_embd.weight")
        return cls(config, adapters, read("output_norm.weight").astype(np.float32), eps, head)


# --------------------------------------------------------------------------- verdicts during a verify pass


@dataclass
class ExitVerdict:
    layer: int  # the exit that decided it
    accepted: int  # draft tokens this exit would keep
    tokens: list[int]  # draft_ids[:accepted] + [this exit's next token]
    confidence: float  # max softmax probability over the candidates of row `accepted`


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
    """The enabled exits of one verify pass, scored from the engine's taps while the pass runs.

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

    def __init__(
        self,
        heads: ExitScorer,
        layers: list[int],
        draft_ids: list[int],
        cands: np.ndarray | None = None,
        bonus_candidates: int = 16,
        emit: Callable[[ExitVerdict], None] | None = None,
    ):
        self.heads = heads
        self.layers = list(layers)
        self.draft_ids = list(draft_ids)  # [k]
        self.cands = cands  # [k, K] int32 or None (full vocabulary)
        self.bonus_candidates = bonus_candidates
        self.emit = emit  # called with each verdict that differs from the last sent
        self.verdicts: list[ExitVerdict] = []  # every exit that ran, emitted or not, in layer order
        self.ms = 0.0  # time spent in exit heads (and emit) this pass
        self.failed = False  # an exit raised: the rest of the pass runs without exits
        self._rows: tuple[np.ndarray, np.ndarray] | None = None  # candidate ids, dup mask [k, K + 1]
        self._bonus_ids: np.ndarray | None = None  # [bonus_candidates] once the full row ran
        self._last_sent: list[int] | None = None

    @property
    def taps(self) -> dict[int, Callable[[Any], None]]:
        """layer -> tap body, for `Target.score(..., taps=...)`."""
        return {l: functools.partial(self._tap, l) for l in self.layers}

    @property
    def reached_bonus(self) -> bool:
        """Whether an exit of this pass accepted the whole draft (and paid the bonus row's full head)."""
        return self._bonus_ids is not None

    def agreeing_layer(self, tokens: list[int]) -> int | None:
        """The earliest exit whose verdict equals the final one (tokens = committed this round), if any."""
        return next((v.layer for v in self.verdicts if v.tokens == list(tokens)), None)

    def _tap(self, layer: int, hidden: Any) -> None:  # hidden [k + 1, H]
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

    def score(self, layer: int, hidden: Any) -> ExitVerdict:
        """The greedy verdict of exit `layer` on the pass's draft rows, hidden [k + 1, H]."""
        k = len(self.draft_ids)
        if hidden.ndim != 2 or hidden.shape[0] != k + 1:
            raise ValueError(f"exit {layer}: expected hidden [k + 1 = {k + 1}, H], got {list(hidden.shape)}")
        accepted = k
        if k:
            ids, dup = self._candidates()  # [k, K + 1] each, or None
            logits = self.heads.logits(layer, hidden[:k], ids)  # [k, K + 1] or [k, vocab]
            if dup is not None:
                logits = np.where(dup, -np.inf, logits)
            best = logits.argmax(-1)  # [k] column index
            best_ids = best if ids is None else np.take_along_axis(ids, best[:, None], 1)[:, 0]
            accepted = first_rejection(np.asarray(self.draft_ids), best_ids)
        if accepted < k:
            row_ids, row = (None if ids is None else ids[accepted]), logits[accepted]
        else:
            row_ids, row = self._bonus_row(layer, hidden[k:])
        row = np.asarray(row, np.float64)
        j = int(row.argmax())
        confidence = 1.0 / float(np.exp(row - row[j]).sum())  # softmax over this row's candidates
        if not np.isfinite(confidence):
            raise ValueError(f"exit {layer}: non-finite confidence {confidence}")
        token = j if row_ids is None else int(row_ids[j])
        return ExitVerdict(layer, accepted, self.draft_ids[:accepted] + [token], min(1.0, confidence))

    def _candidates(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        if self.cands is None:
            return None, None
        if self._rows is None:
            self._rows = candidate_rows(np.asarray(self.draft_ids), np.asarray(self.cands))
        return self._rows

    def _bonus_row(self, layer: int, hidden: Any) -> tuple[np.ndarray | None, np.ndarray]:
        """(candidate ids or None for all, logits) of the bonus row; hidden [1, H]."""
        if self._bonus_ids is None:
            row = self.heads.logits(layer, hidden)[0]  # [vocab]: once per pass
            n = min(self.bonus_candidates, row.shape[0])
            self._bonus_ids = np.sort(np.argpartition(row, -n)[-n:])  # ascending: ties as in the full head
            return None, row
        return self._bonus_ids, self.heads.logits(layer, hidden, self._bonus_ids[None])[0]
