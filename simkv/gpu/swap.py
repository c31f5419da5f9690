"""Batched swap of KV blocks between the device cache and a pinned host swap space.

Device layout: the model's caches as ONE stacked tensor
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 of dim 1 is K, 1 is V);
`caches[layer, 0]` and `caches[layer, 1]` are the per-layer k_cache / v_cache the kernels take.
A list of per-layer `(k_cache, v_cache)` pairs is accepted too.

Host layout: `HostSwapSpace.blocks` is `[num_host_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`, block-major, so that one host block (all layers, K and V) is contiguous and a run of
consecutive host blocks is one contiguous range.

A swap moves a set of blocks given as (device_block, host_block) pairs: the device gathers them
(all layers, K and V) into a staging tensor with index_select, then ONE copy per run of consecutive
host blocks crosses the host link (one copy in all when the host blocks are consecutive, which a
first-fit host allocator gives). Swap-in is the mirror image. Blocks move in chunks of at most
STAGING_BYTES, so that a large swap's transient device memory stays bounded (gathering 1,000
blocks of an 8B model at once held ~4 GiB beside the KV pool). Copies are asynchronous on the
current stream; the mapping is host data, so nothing here waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simkv.sizing import SWAP_STAGING_CHUNK_BYTES as STAGING_BYTES  # per chunk of a swap

Caches = torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class HostSwapSpace:
    """Host memory for swapped-out blocks: `blocks[host_block]` holds every layer's K and V."""

    blocks: torch.Tensor  # [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

    @classmethod
    def allocate(cls, num_blocks: int, caches: Caches, pin_memory: bool | None = None) -> "HostSwapSpace":
        """Host space for `num_blocks` blocks shaped like `caches`; pinned when CUDA is available."""
        num_layers, block_shape, dtype = _cache_geometry(caches)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        blocks = torch.empty((num_blocks, num_layers, 2, *block_shape), dtype=dtype, pin_memory=pin_memory)
        return cls(blocks)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def bytes_per_block(self) -> int:
        return self.blocks[0].numel() * self.blocks.element_size()


def _cache_geometry(caches: Caches) -> tuple[int, tuple[int, ...], torch.dtype]:
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 6 or caches.shape[1] != 2:
            raise ValueError(
                "stacked caches must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
                f"got {tuple(caches.shape)}"
            )
        return caches.shape[0], tuple(caches.shape[3:]), caches.dtype
    k0, _ = caches[0]
    return len(caches), tuple(k0.shape[1:]), k0.dtype


def _sorted_mapping(mapping) -> torch.Tensor:
    """(device_block, host_block) pairs as a CPU int64 [n, 2] tensor, sorted by host block."""
    mapping = torch.as_tensor(mapping, dtype=torch.int64, device="cpu").reshape(-1, 2)
    return mapping[torch.argsort(mapping[:, 1])]


def _chunks(mapping: torch.Tensor, bytes_per_block: int):
    """Consecutive slices of a sorted mapping of at most STAGING_BYTES each (one block at least)."""
    step = max(1, STAGING_BYTES // max(1, bytes_per_block))
    for start in range(0, len(mapping), step):
        yield mapping[start:start + step]


def _host_runs(host_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive host ids: (position in the staging tensor, first host id, length)."""
    ids = host_ids.tolist()
    runs = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def _gather(caches: Caches, device_ids: torch.Tensor) -> torch.Tensor:
    """Selected blocks of every layer, block-major: [n, num_layers, 2, block_size, heads, dim]."""
    if isinstance(caches, torch.Tensor):
        return caches.index_select(2, device_ids).permute(2, 0, 1, 3, 4, 5).contiguous()
    num_layers, block_shape, dtype = _cache_geometry(caches)
    staging = torch.empty((len(device_ids), num_layers, 2, *block_shape), dtype=dtype, device=device_ids.device)
    for layer, (k_cache, v_cache) in enumerate(caches):
        staging[:, layer, 0] = k_cache.index_select(0, device_ids)
        staging[:, layer, 1] = v_cache.index_select(0, device_ids)
    return staging


def _scatter(caches: Caches, device_ids: torch.Tensor, staging: torch.Tensor) -> None:
    if isinstance(caches, torch.Tensor):
        caches.index_copy_(2, device_ids, staging.permute(1, 2, 0, 3, 4, 5))
        return
    for layer, (k_cache, v_cache) in enumerate(caches):
        k_cache.index_copy_(0, device_ids, staging[:, layer, 0])
        v_cache.index_copy_(0, device_ids, staging[:, layer, 1])


def _device_of(caches: Caches) -> torch.device:
    return caches.device if isinstance(caches, torch.Tensor) else caches[0][0].device


def swap_out(caches: Caches, swap_space: HostSwapSpace, mapping) -> None:
    """Copy device blocks to host blocks: mapping is (device_block, host_block) pairs, [n, 2].

    All layers' K and V of each block move; the device copy is left as is (the caller frees it).
    Asynchronous on the current stream: synchronise before reading the host blocks on the CPU.
    """
    mapping = _sorted_mapping(mapping)
    device = _device_of(caches)
    non_blocking = swap_space.blocks.is_pinned()
    for chunk in _chunks(mapping, swap_space.bytes_per_block):
        staging = _gather(caches, chunk[:, 0].to(device))
        for pos, host_start, length in _host_runs(chunk[:, 1]):
            swap_space.blocks[host_start : host_start + length].copy_(staging[pos : pos + length], non_blocking=non_blocking)
        # Released before the next chunk's gather (the copies are queued on this stream, so the
        # allocator hands the memory out again only to later work): at most the two chunks of
        # one gather are alive, which sizing reserves (SWAP_STAGING_CHUNKS).
        del staging


def swap_in(caches: Caches, swap_space: HostSwapSpace, mapping) -> None:
    """Copy host blocks back into device blocks: mapping is (device_block, host_block) pairs, [n, 2]."""
    mapping = _sorted_mapping(mapping)
    device = _device_of(caches)
    blocks = swap_space.blocks
    non_blocking = blocks.is_pinned()
    for chunk in _chunks(mapping, swap_space.bytes_per_block):
        staging = torch.empty((len(chunk), *blocks.shape[1:]), dtype=blocks.dtype, device=device)
        for pos, host_start, length in _host_runs(chunk[:, 1]):
            staging[pos : pos + length].copy_(blocks[host_start : host_start + length], non_blocking=non_blocking)
        _scatter(caches, chunk[:, 0].to(device), staging)
        del staging       # before the next chunk's buffer (see swap_out)


def order_swap_outs(plan, kv) -> tuple:
    """Split `plan.swap_out` into the pairs applied before the block copies and those after.

    Swap-outs normally come first: a block a victim gives up may become a copy's destination in
    the same step. But a request can also preempt itself (swap mode) after one of its sequences
    got a copy-on-write this step; its swap-out of that destination must see the copy. That
    destination is then free once scheduling is over, which tells the two cases apart (given
    the KV manager); its last swap-out goes after the copies.
    """
    if not (plan.block_copies and plan.swap_out):
        return plan.swap_out, []
    last = {device: i for i, (device, _) in enumerate(plan.swap_out)}
    late = {last[dst] for _, dst in plan.block_copies if dst in last and kv.is_free(dst)}
    if not late:
        return plan.swap_out, []
    return ([p for i, p in enumerate(plan.swap_out) if i not in late],
            [plan.swap_out[i] for i in sorted(late)])
