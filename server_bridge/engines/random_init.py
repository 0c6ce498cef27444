"""A target directory whose weights are a recipe: a Llama built from its config on the device, random weights and a
planted greedy path, so that a GPU benchmark of a 7B shape writes no weights and carries none.

The directory (tools/models/random_target.py writes it) holds config.json, the tokenizer, `successor.npy` and
`random_init.json`: {"seed", "init_std", "successor", "version"}. The weights, drawn on the device:

  embeddings        N(0, 1)
  Q, K, V, gate, up N(0, init_std^2)
  attention out, down  N(0, (init_std / sqrt(2 x layers))^2)  (GPT-2's scaled init)
  norms             ones
  LM head           row v = the sum of the embeddings of the tokens whose successor is v, / sqrt(hidden)

so the greedy token after any prefix is successor[last token] (random_target.py says why). Only the torch engine
reads it (`server-bridge serve --engine torch --target DIR`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

RECIPE = "random_init.json"


def is_recipe(model_dir: str | Path) -> bool:
    return (Path(model_dir) / RECIPE).is_file()


def build(model_dir: str | Path, device: Any, dtype: Any) -> Any:
    """The model of `model_dir`'s config, its weights drawn on `device` in `dtype` by the recipe."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    recipe = json.loads((model_dir / RECIPE).read_text())
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    successor = torch.from_numpy(np.load(model_dir / recipe["successor"])).to(device)
    std = float(recipe["init_std"])
    out_std = std / math.sqrt(2 * config.num_hidden_layers)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(int(recipe["seed"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, out_std, generator=gen)
            elif "lm_head" not in name:
                p.normal_(0.0, std, generator=gen)
        model.get_output_embeddings().weight.copy_(planted_head(model.get_input_embeddings().weight, successor))
    return model


def planted_head(embed: Any, successor: Any) -> Any:
    """[vocab, hidden] float32 on embed's device: row v is the sum of the embeddings of the tokens whose successor
    is v, / sqrt(hidden), so after the final norm the last token's own embedding makes its successor's logit win."""
    import torch

    head = torch.zeros(embed.shape, dtype=torch.float32, device=embed.device)
    head.index_add_(0, successor.to(embed.device), embed.float())
    return head.mul_(1.0 / math.sqrt(embed.shape[1]))
