"""Cost features that the plan does not carry: what the step's decodes read again.

A KV block that several of a step's decode tables hold is read once from HBM and again from L2
(simkv.costmodel.shared_reads). How many repeats a step has depends on the KV manager's
reference counts at the time the step runs, so the simulator's executor counts them from the
plan and a read-only view of the KV manager and the running requests; the real engine never
needs them.
"""
from __future__ import annotations


def shared_read_tokens(plan, kv, running) -> tuple:
    """(repeat tokens, first-repeat tokens) of the step's decodes: per block several decode
    tables hold, block_size x (holders - 1), summed; and block_size x the blocks two or more of
    them hold. The KV manager keeps both counts over every table in O(1); the shares of the
    running tables outside the step's decodes (prefill chunks, sequences the step leaves out)
    are taken out (tests/test_fuzz.py checks both against counts over the decode tables)."""
    decode_context = plan.decode_context_tokens
    shared = kv.num_shared_block_refs if decode_context else 0
    if not shared:
        return 0, 0
    shared_blocks = kv.num_shared_blocks
    others = [item.seq for item in plan.scheduled if not item.is_decode]
    if len(plan.scheduled) < sum(len(req.seqs) for req in running):
        scheduled = {id(item.seq) for item in plan.scheduled}
        others += [seq for req in running for seq in req.seqs if id(seq) not in scheduled]
    if others:
        refs, blocks = kv.shared_of(others)
        shared -= refs
        shared_blocks -= blocks
    assert shared_blocks >= 0, "shared blocks among the decodes below zero"
    repeats = min(decode_context, shared * kv.block_size)
    return repeats, min(repeats, shared_blocks * kv.block_size)


def annotate_shared_reads(plan, kv, running) -> None:
    """Set the plan's `decode_shared_context_tokens` and `decode_shared_block_tokens`."""
    plan.decode_shared_context_tokens, plan.decode_shared_block_tokens = \
        shared_read_tokens(plan, kv, running)


def decode_run_shared_reads(run, kv):
    """`shared(k) -> (repeat tokens, first-repeat tokens)` of step k of a decode run
    (simkv.engine.decode_run): what `annotate_shared_reads` sets on that step's plan, or None
    when it sets nothing (no block is shared). Every running sequence decodes and no reference
    changes inside a run, so the KV manager's two counts hold for all its steps and only the
    decode context moves."""
    refs = kv.num_shared_block_refs if kv is not None else 0
    if not refs:
        return None
    bs = kv.block_size
    repeats_cap, first_cap = refs * bs, kv.num_shared_blocks * bs
    context0, n = run.context_tokens - run.n, run.n

    def shared(k: int) -> tuple:
        repeats = min(context0 + n * k, repeats_cap)
        return repeats, min(repeats, first_cap)
    return shared
