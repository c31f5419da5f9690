"""The KV manager as the scheduler, the metrics recorder and the executors see it.

Two implementations: `PagedKVCacheManager` (paged blocks, prefix caching, copy-on-write forks,
swap) and `ContiguousKVCacheManager` (a reservation of max_model_len per sequence, the
baseline). Nothing outside simkv/engine/kv reaches into their pools.
"""
from __future__ import annotations

from typing import Protocol


class KVManager(Protocol):
    block_size: int
    num_blocks: int
    copies: list                   # (src, dst) copy-on-write copies decided this step

    # -- usage counters -----------------------------------------------------------------------
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int    # free blocks a prefix lookup can still hit
    num_shared_block_refs: int     # references beyond the first, over every shared block
    num_shared_blocks: int         # blocks with more than one reference
    num_cow_copies: int
    swapped_out_blocks: int
    swapped_in_blocks: int

    def allocated_slots(self, table_blocks: int, running) -> int:
        """Token slots the running requests' sequences hold: `table_blocks` (their block
        tables' lengths, summed) times the block size, or their reservations."""

    def seq_slots(self, seq) -> int:
        """Token slots held for one sequence."""

    def is_free(self, block: int) -> bool:
        """Whether a device block is in the free queue now."""

    # -- admission ----------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int, n: int = 1, prompt_tokens: int = 0) -> int: ...

    def max_admissible_blocks(self) -> int: ...

    def prefix_lookup(self, seq) -> tuple: ...

    def allocate_slots(self, seq, num_new_tokens: int, cached_blocks=(),
                       admission: bool = False, reserve_tokens: int = 0) -> bool:
        """All or nothing: slots for `num_new_tokens` more tokens of `seq`, or False and no
        change; with `reserve_tokens`, free blocks for its first `reserve_tokens` tokens must
        exist too (only the asked-for slots are taken)."""

    # -- lifetime -----------------------------------------------------------------------------
    def fork(self, parent, child, num_tokens: int | None = None) -> None: ...

    def free(self, seq) -> None: ...

    def take_copies(self) -> list: ...

    def swap_out(self, seqs) -> list | None: ...

    def can_swap_in(self, seqs) -> bool: ...

    def swap_in(self, seqs) -> list | None: ...

    def shared_of(self, seqs) -> tuple:
        """(refs, blocks) of `num_shared_block_refs` and `num_shared_blocks` that `seqs`'
        tables account for."""

    def check_integrity(self) -> None:
        """Assert the invariants (free + cached + in use == total, reference counts)."""
