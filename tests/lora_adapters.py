"""PEFT LoRA adapters with random weights on a base model, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: str, out: Path, seed: int, rank: int = 8, targets=None, rslora: bool = False
) -> str:
    """Write a PEFT adapter for base into out: A and B random (B scaled up so the adapter
    changes a random base's greedy choices). Returns out as a string."""
    import peft

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets or ALL_PROJECTIONS,
        use_rslora=rslora,
        init_lora_weights=False,
    )
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    model.save_pretrained(out)
    return str(out)
