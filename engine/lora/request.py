"""LoRARequest: which adapter a request runs with (vLLM's, same fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory, named. Requests with the same name share the adapter (and only
    they share prefix-cache blocks); lora_int_id is vLLM's numeric id (> 0)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
