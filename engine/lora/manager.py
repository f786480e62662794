"""LoRAManager: the adapters an engine knows (loaded, least recently used dropped past
max_cpu_loras), the max_loras slots of stacked weights the forward reads, and each forward's
token -> slot map."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pdserve.engine.config import LoRAConfig
from pdserve.engine.lora.adapter import LoRAAdapter, load_adapter
from pdserve.engine.lora.layers import LoRABatch, LoRASlots
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.models.llama import CausalLM, Linear

logger = logging.getLogger(__name__)


class LoRAManager:
    """Owned by the engine (engine thread). add() loads and checks an adapter when a request
    names it; activate() puts a step's adapters in slots; set_batch() tells the projections
    which slot each token uses."""

    def __init__(self, model: CausalLM, config: LoRAConfig) -> None:
        self.model = model
        self.config = config
        self.batch = LoRABatch(config.max_loras, config.max_lora_rank)
        self.projections: dict[str, Linear] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and ".layers." in f".{name}":
                module.lora = LoRASlots(
                    module.weight.shape[1], module.shard_sizes, self.batch, model.dtype
                )
                self.projections[name] = module
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        """name -> adapter, least recently used first (a cache: an evicted adapter that a
        step needs is read again from its directory)."""
        self.known: dict[str, LoRARequest] = {}
        """Every adapter requests have named (no weights): where to reload one from."""
        self.slots: list[str | None] = [None] * config.max_loras
        """The adapter name in each slot."""

    def add(self, request: LoRARequest, keep: Sequence[str] = ()) -> LoRAAdapter:
        """The adapter of request, loaded (and checked) if it is not yet; ValueError if bad or
        if a different adapter already has its name."""
        known = self.known.get(request.lora_name)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is loaded from {known.lora_path}, not "
                f"{request.lora_path}"
            )
        adapter = self.loaded.get(request.lora_name)
        if adapter is not None:
            self.loaded.move_to_end(request.lora_name)
            return adapter
        adapter = load_adapter(request, self.model, self.config.max_lora_rank)
        self.known[request.lora_name] = request
        self.loaded[request.lora_name] = adapter
        self._evict({request.lora_name, *keep})
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, %d projections)",
            request.lora_name,
            request.lora_path,
            adapter.rank,
            len(adapter.weights),
        )
        return adapter

    def remove(self, name: str) -> bool:
        """Forget an adapter (vLLM's unload); False if it was not loaded."""
        if self.known.pop(name, None) is None:
            return False
        self.loaded.pop(name, None)
        if name in self.slots:
            self._clear_slot(self.slots.index(name))
        return True

    def _evict(self, keep: set[str]) -> None:
        """Drop the least recently used adapters past max_cpu_loras (never one in a slot or in
        keep)."""
        for name in list(self.loaded):
            if len(self.loaded) <= self.config.num_cpu_loras:
                return
            if name not in self.slots and name not in keep:
                del self.loaded[name]

    def activate(self, names: Sequence[str]) -> dict[str, int]:
        """Slots for a step's adapters (at most max_loras distinct: the scheduler's limit),
        writing into a slot the weights of an adapter not in one yet."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"{len(wanted)} adapters in one step, max_loras {len(self.slots)}")
        free = [i for i, name in enumerate(self.slots) if name not in wanted]
        for name in wanted:
            if name in self.slots:
                continue
            adapter = self.loaded.get(name)
            if adapter is None:  # evicted from memory since its request was added
                adapter = self.add(self.known[name], keep=wanted)
            slot = free.pop(0)
            self._write_slot(slot, adapter)
        for name in wanted:
            if name in self.loaded:
                self.loaded.move_to_end(name)
        return {name: self.slots.index(name) for name in wanted}

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for path, module in self.projections.items():
            assert module.lora is not None
            for shard in range(len(module.shard_sizes)):
                pair = adapter.weights.get((path, shard))
                module.lora.write(slot, shard, *(pair or (None, None)))
        self.slots[slot] = adapter.name

    def _clear_slot(self, slot: int) -> None:
        for module in self.projections.values():
            assert module.lora is not None
            for shard in range(len(module.shard_sizes)):
                module.lora.write(slot, shard, None, None)
        self.slots[slot] = None

    def set_batch(self, token_adapters: Sequence[tuple[str | None, int]]) -> None:
        """The next forward's tokens, as runs of (adapter name or None, token count) in batch
        order."""
        names = [name for name, _ in token_adapters if name is not None]
        if not names:
            self.batch.set(None)
            return
        slots = self.activate(names)
        index = torch.cat(
            [
                torch.full((count,), slots[name] if name is not None else -1, dtype=torch.long)
                for name, count in token_adapters
            ]
        )
        self.batch.set(index)
