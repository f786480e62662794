"""A whole batch's adapters applied in two matmuls per projection.

Each adapted projection (a models/llama.py Linear, fused or not) holds every slot's weights
stacked: A_all [slots x shards x R, in] and B_all [out, slots x shards x R] (R = max rank; a
lower-rank adapter's extra rows and columns are zero; scaling folded into B). A token's update
is ((x A_all^T) * mask) B_all^T, where the mask keeps the columns of the token's own slot: one
pair of GEMMs over the flattened batch whatever mix of adapters (and base-model tokens, whose
mask row is zero) it holds, with no loop over requests. The extra work is slots x shards x R
columns, small next to the projection itself at the ranks LoRA uses.
"""

from __future__ import annotations

import torch


class LoRABatch:
    """Which slot each token of the current forward uses (-1: the base model), and the masks
    the projections multiply by, made once per forward and shared."""

    def __init__(self, num_slots: int, max_rank: int) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.token_slots: torch.Tensor | None = None
        """[T] int64 slot per token, or None when no token of the forward uses an adapter."""
        self.first_slot = 0
        self.end_slot = 0
        """The slots the forward uses lie in [first_slot, end_slot): only their columns are
        computed (one adapter in a step costs one slot's columns, not max_loras')."""
        self.uniform = False
        """Every token (padding aside) uses the same adapter: no mask needed."""
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def set(self, token_slots: torch.Tensor | None) -> None:
        self.token_slots = token_slots
        self._masks = {}
        if token_slots is None:
            return
        used = token_slots[token_slots >= 0]
        self.first_slot, self.end_slot = int(used.min()), int(used.max()) + 1
        self.uniform = used.numel() == token_slots.numel() and self.end_slot - self.first_slot == 1

    def mask(self, rows: int, num_shards: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, used slots x shards x R]: 1 where the column belongs to the row's slot (rows
        past the batch are padding: all 0)."""
        key = (rows, num_shards, dtype)
        mask = self._masks.get(key)
        if mask is None:
            assert self.token_slots is not None
            slots = torch.full((rows,), -1, dtype=torch.long)
            slots[: self.token_slots.shape[0]] = self.token_slots
            width = num_shards * self.max_rank
            columns = torch.arange(self.first_slot * width, self.end_slot * width)
            mask = (columns[None, :] // width == slots[:, None]).to(dtype)
            self._masks[key] = mask
        return mask


class LoRASlots:
    """The stacked adapter weights of one projection."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: tuple[int, ...],
        batch: LoRABatch,
        dtype: torch.dtype,
    ) -> None:
        self.shard_sizes = shard_sizes
        self.batch = batch
        self.width = len(shard_sizes) * batch.max_rank
        """Columns per slot."""
        self.a = torch.zeros(batch.num_slots * self.width, in_features, dtype=dtype)
        self.b = torch.zeros(sum(shard_sizes), batch.num_slots * self.width, dtype=dtype)

    def write(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put one shard's A [r, in] and scaled B [shard rows, r] in slot (None: zeros, the
        shard is not adapted)."""
        rank = self.batch.max_rank
        first = slot * self.width + shard * rank
        rows = slice(sum(self.shard_sizes[:shard]), sum(self.shard_sizes[: shard + 1]))
        self.a[first : first + rank] = 0
        self.b[rows, first : first + rank] = 0
        if a is not None and b is not None:
            r = a.shape[0]
            self.a[first : first + r] = a
            self.b[rows, first : first + r] = b

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter update of x (y when no token uses an adapter)."""
        batch = self.batch
        if batch.token_slots is None:
            return y
        columns = slice(batch.first_slot * self.width, batch.end_slot * self.width)
        a, b = self.a[columns], self.b[:, columns]
        hidden = x @ a.T
        if not (batch.uniform and x.shape[0] == batch.token_slots.shape[0]):
            hidden *= batch.mask(x.shape[0], len(self.shard_sizes), x.dtype)
        return y.addmm_(hidden, b.T)
