"""Early-exit adapters for the target (FSD): after chosen layers, a small residual adapter whose
output goes through the target's own final norm and LM head. Base weights stay frozen.

An exit's verdict is a hint for pre-drafting on the robot; only the final
layer decides what is committed, so exits never affect exactness. To keep them
cheap, an exit may score only candidate tokens (for a draft position, the
draft's top-K): one full-vocabulary head over 5 positions costs about as much
as a sixth of the whole verify pass on this CPU (DESIGN.md).

Layer numbering: exit `l` reads the residual stream after decoder block `l`
(1-based), i.e. `hidden_states[l]` of a transformers forward pass.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


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
