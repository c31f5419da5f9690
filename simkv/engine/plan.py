"""StepPlan: everything one engine iteration does, as plain data.

The scheduler builds it; an executor carries it out (the simulator by asking a cost model how long
it takes, the real engine by running it on the GPU). Block tables are the sequences' own lists,
read when the plan is executed: an executor consumes a plan before asking for the next one.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledSeq:
    """Tokens [start, start + num_tokens) of one sequence are computed this step."""

    seq: object            # simkv.engine.request.Sequence
    start: int
    num_tokens: int
    is_decode: bool

    @property
    def block_table(self) -> list:
        return self.seq.block_table

    @property
    def context_len(self) -> int:
        """Tokens of context after this step (the attention length of its last query)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class StepPlan:
    step: int
    now_s: float
    scheduled: list = field(default_factory=list)      # ScheduledSeq, prefill chunks and decodes
    # what the step computes, counted
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_seqs: int = 0
    decode_context_tokens: int = 0      # sum of decode sequences' context lengths
    decode_max_context: int = 0         # the longest decode context (the kernel's busiest program)
    # repeated reads of blocks several decode tables hold: set by the simulator's executor
    # (simkv.costmodel.features), which reads the KV manager's reference counts; 0 on the GPU
    decode_shared_context_tokens: int = 0   # (holders - 1) x block_size summed over blocks
    decode_shared_block_tokens: int = 0     # block_size x the blocks two or more tables hold
    prefill_context_tokens: int = 0     # sum of prefill chunks' context lengths after the step
    prefill_attention_pairs: int = 0    # query-key pairs of prefill attention (causal)
    # memory operations the executor performs before the forward
    block_copies: list = field(default_factory=list)   # (src, dst) device blocks
    swap_out: list = field(default_factory=list)       # (device, host)
    swap_in: list = field(default_factory=list)        # (host, device)
    # request events decided at scheduling time
    preempted: list = field(default_factory=list)      # request ids
    cancelled: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    forked: list = field(default_factory=list)         # (parent seq_id, child seq_id)
    # state snapshot after scheduling
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_decode_seqs(self) -> int:
        return len(self.scheduled) - self.num_prefill_seqs

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in \
            and not self.block_copies

    def count_tokens(self) -> None:
        """Fill in the counts of what `scheduled` computes: prefill and decode tokens, prefill
        chunks, context lengths, the longest decode context, prefill attention's pairs."""
        scheduled = self.scheduled
        starts = [item.start for item in scheduled if item.is_decode]
        decode_tokens = len(starts)
        prefill_tokens = prefill_seqs = prefill_ctx = pairs = 0
        if decode_tokens < len(scheduled):
            for item in scheduled:
                if not item.is_decode:
                    n = item.num_tokens
                    prefill_seqs += 1
                    prefill_tokens += n
                    prefill_ctx += item.start + n
                    pairs += n * item.start + n * (n + 1) // 2
        self.decode_max_context = max(starts) + 1 if starts else 0
        self.num_prefill_tokens = prefill_tokens
        self.num_decode_tokens = decode_tokens
        self.num_prefill_seqs = prefill_seqs
        self.decode_context_tokens = sum(starts) + decode_tokens     # contexts: start + 1
        self.prefill_context_tokens = prefill_ctx
        self.prefill_attention_pairs = pairs

    def slot_mapping(self, block_size: int) -> list:
        """Cache slot of every token computed this step, in `scheduled` order."""
        slots = []
        for item in self.scheduled:
            table = item.seq.block_table
            for pos in range(item.start, item.start + item.num_tokens):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        return slots
