"""Multi-LoRA: PEFT adapters applied per request on one base model (engine/lora/README in
the module docstrings): request.py names an adapter, adapter.py loads and checks one, layers.py
applies the adapters of a whole batch in two matmuls per projection, manager.py keeps them in
slots and memory."""

from pdserve.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
