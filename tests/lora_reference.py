"""peft references for the LoRA tests: random adapters saved as PEFT folders."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(
    base: torch.nn.Module, folder: Path, rank: int, alpha: float, rslora: bool, targets, seed, *, scale: float = 0.15
):
    """A PEFT adapter of random (non-zero) A and B, normal of std ``scale``, on ``base``, saved to
    ``folder``; returns the peft model (the reference) and leaves ``base`` itself unchanged."""
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets), init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(folder)
    return model.eval()
