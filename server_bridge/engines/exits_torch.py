"""The early-exit adapters as torch modules: what `server-bridge train-exits` trains and the torch engine runs.

What the exits are and how a verify pass uses them: server_bridge/exits.py. The
llamacpp engine runs the same saved adapters in numpy (`exits.NumpyExitHeads`).

What the exits cost per verify pass of a 4-token draft, on 1 thread (medians of 40
interleaved passes, both engines in one run; `python -m tools.bench.exit_cost --out docs/exits`):

                                                       torch    llamacpp
  pass without exits                                  100.8 ms   65.5 ms
  with exits at 12, 18, 22, 26 on K=8 candidates      117.2      77.7    (draft accepted in full)
  the same, draft rejected at row 0                   104.9      68.0
  the bonus row's 1-row full-vocabulary head           11.2       8.6    (once per pass)
  one exit's candidate scoring, 4 rows x 9              0.7       0.3
  the exits on the full vocabulary                    199.1     180.9

So exits score candidates only; the one full-head row at the bonus position
is most of their cost when the draft is accepted.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..exits import ExitConfig


class ExitAdapter(nn.Module):
    """h -> h + up(silu(down(h))); `up` starts at zero, so an untrained exit is the plain logit lens."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return h + self.up(F.silu(self.down(h)))


class ExitHeads(nn.Module):
    n_vocab: int | None = None  # rows of the LM head that name tokens (None: all); the verifier sets it

    def __init__(self, config: ExitConfig):
        super().__init__()
        self.config = config
        self.adapters = nn.ModuleDict({str(l): ExitAdapter(config.hidden, config.rank) for l in config.layers})

    @property
    def layers(self) -> list[int]:
        return self.config.layers

    def features(self, model: Any, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head sees at this exit: final_norm(adapter(hidden)), [n, hidden] -> [n, hidden].

        model: a causal LM or a vision-language model (its text decoder's final norm: `get_decoder()`)."""
        return model.get_decoder().norm(self.adapters[str(layer)](hidden))

    def logits(
        self, model: Any, layer: int, hidden: torch.Tensor, candidates: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Exit logits at `layer` for hidden [n, hidden].

        candidates None -> [n, vocab]; candidates [n, K] token ids -> [n, K] (only those rows of the head).
        """
        h = self.features(model, layer, hidden)  # [n, hidden]
        weight = model.get_output_embeddings().weight[: self.n_vocab]  # [vocab, hidden], the real rows
        if candidates is None:
            return h @ weight.T
        return torch.einsum("nh,nkh->nk", h, weight[candidates])

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path.with_suffix(".safetensors"))
        )
        path.with_suffix(".json").write_text(json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(cls, path: str | Path, layers: list[int] | None = None) -> "ExitHeads":
        """Load saved adapters; `layers` keeps a subset of them (the robot's --exits)."""
        from safetensors.torch import load_file

        path = Path(path)
        config = ExitConfig.load(path)
        keep = config.pick(layers)
        state = load_file(str(path.with_suffix(".safetensors")))
        heads = cls(ExitConfig(keep, config.hidden, config.rank, config.target, config.info))
        heads.load_state_dict({k: v for k, v in state.items() if int(k.split(".")[1]) in keep})
        return heads.eval().requires_grad_(False)


class TorchExitScorer:
    """ExitHeads bound to the torch engine's model: the `exits.ExitScorer` that ExitPass calls.

    The heads run on the model's device and dtype; only the scored rows ([n, K] candidates, or one
    [vocab] bonus row per pass) come back to the host as float32.
    """

    def __init__(self, heads: ExitHeads, model: Any):
        self.heads = heads
        self.model = model
        self.layers = list(heads.layers)
        self.config = heads.config

    def logits(self, layer: int, hidden: torch.Tensor, candidates: np.ndarray | None = None) -> np.ndarray:
        with torch.inference_mode():
            cands = None if candidates is None else torch.from_numpy(np.asarray(candidates)).to(hidden.device)
            return self.heads.logits(self.model, layer, hidden, cands).float().cpu().numpy()
