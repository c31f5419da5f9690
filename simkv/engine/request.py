"""Requests and their sequences: one token model for every request.

A sequence's `num_tokens` counts the tokens it has (prompt + sampled outputs); `num_computed_tokens`
counts those whose K/V are in the cache. A step computes some of the difference; when the whole
difference is computed, the step samples one new token. A request with `n > 1` prefills one
sequence and forks it into `n` sampling sequences when the prompt is done.
"""
from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass, field
from typing import Optional


class RequestStatus(enum.IntEnum):
    WAITING = 0      # not yet admitted, or preempted in recompute mode
    RUNNING = 1
    SWAPPED = 2      # preempted in swap mode: its blocks are in host memory
    COMPLETED = 3
    CANCELLED = 4
    REJECTED = 5


FINAL_STATUSES = (RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.REJECTED)


def stable_key(text: str) -> int:
    """A process-independent integer for a string (Python's str hash is randomised per process)."""
    return zlib.crc32(text.encode()) if text else 0


@dataclass(eq=False, slots=True)
class Sequence:
    """One token stream with its own block table (a request has one, or n after the fork)."""

    seq_id: int
    request: "Request"
    sample: int                       # 0..n-1
    num_tokens: int                   # prompt + sampled tokens so far
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    block_table: list = field(default_factory=list)
    block_hashes: list = field(default_factory=list)   # chained hashes of full blocks, grows lazily
    num_cached_blocks: int = 0        # leading blocks of block_table registered in the hash index
    host_table: Optional[list] = None  # host block ids while swapped out
    token_ids: Optional[list] = None  # the real engine's tokens (prompt + outputs); None in simulation
    last_token_s: float = 0.0
    finished: bool = False


@dataclass(eq=False, slots=True)
class Request:
    """A request as the scheduler sees it. Times in seconds of the executor's clock."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int                # tokens to generate per sample (the trace's; EOS ignored)
    n: int = 1
    prefix_ids: Optional[tuple] = None  # chained identities at prefix_block_tokens granularity
    prefix_block_tokens: int = 0
    tenant: str = ""
    adapter: str = ""
    mm_key: str = ""                  # multimodal identity (extra hash key)
    cancel_after_s: float = math.nan  # after arrival; NaN = never
    priority: int = 0                 # lower value = more important (vLLM's convention)
    prompt_token_ids: Optional[list] = None  # real engine only
    parent_request_id: int = -1       # the earlier turn this prompt continues (-1: none)
    parent: Optional["Request"] = None  # that turn: this prompt = its prompt + output + more
    mm_spans: Optional[tuple] = None  # ((offset, length, key), ...): multimodal items' tokens
    sample: int = 0                   # a fanned-out child's index (its sequence's sample)
    group: Optional["Request"] = None  # a fanned-out child's request, whose row it shares

    status: RequestStatus = RequestStatus.WAITING
    seqs: list = field(default_factory=list)   # live sequences (not finished)
    all_seqs: list = field(default_factory=list)
    hash_root: int = 0
    admitted_s: float = math.nan      # first admission
    first_token_s: float = math.nan
    finish_s: float = math.nan
    num_preemptions: int = 0
    cached_tokens: int = 0            # prompt tokens served from the prefix cache, all admissions
    queried_tokens: int = 0           # tokens looked up in the prefix cache, all admissions
    first_hit_tokens: int = -1        # cached tokens at its first admission (-1: not yet)
    self_rehit_tokens: int = 0        # cached tokens at re-admissions beyond first_hit_tokens
    lost_tokens: int = 0              # computed tokens discarded by recompute preemption
    recomputed_tokens: int = 0        # discarded tokens computed again (not re-hit in the cache)
    reason: str = ""                  # why rejected
    capped_tokens: int = 0            # output tokens cut so as to end at max_model_len
    children: Optional[list] = None   # a fanned-out request's child requests
    tpot_s: float = math.nan          # a fanned-out request's: its children's mean

    @property
    def max_tokens(self) -> int:
        """Tokens whose K/V a sample holds at most: the last sampled token is never computed."""
        return self.prompt_tokens + self.output_tokens - 1

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES
