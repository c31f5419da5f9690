"""Chained block hashes for prefix caching.

Block i of a sequence is keyed by hash((hash of block i-1, identity of block i's tokens)); the chain
starts at a root built from the extra keys (tenant scope, adapter, multimodal identity), so that
requests that must not share never produce equal hashes.

Token identity comes from real token ids (engine) or, in simulation, from the trace's prefix ids:
a trace gives one chained id per `prefix_block_tokens` tokens, so equal ids at position k mean the
whole prompt up to the end of that trace block is equal. A simulator block is then identified by
the trace id covering its last token and that token's position. Tokens with no shared identity
(the rest of a prompt, sampled tokens) get keys unique to the request (and sample).
"""
from __future__ import annotations

from simkv.engine.request import Request, Sequence, stable_key

_UNIQUE = -1   # marks a key unique to one request; trace ids and positions are never negative here


def hash_root(request: Request, global_scope: bool) -> int:
    """The chain's root for a request: tenant (unless sharing is global), adapter, multimodal key."""
    tenant = 0 if global_scope else stable_key(request.tenant)
    return hash((tenant, stable_key(request.adapter), stable_key(request.mm_key)))


def extend_block_hashes(seq: Sequence, num_full_blocks: int, block_size: int) -> list:
    """Grow `seq.block_hashes` to cover its first `num_full_blocks` full blocks; returns the list."""
    hashes = seq.block_hashes
    i = len(hashes)
    if i >= num_full_blocks:
        return hashes
    req = seq.request
    parent = hashes[-1] if hashes else req.hash_root
    tokens = seq.token_ids
    prompt = req.prompt_tokens
    ids = req.prefix_ids
    pbt = req.prefix_block_tokens
    if tokens is None:              # the simulator: trace ids, else keys unique to the request
        rid, sample = req.request_id, seq.sample
        append = hashes.append
        while i < num_full_blocks:
            last = (i + 1) * block_size - 1
            if last < prompt and ids is not None and last // pbt < len(ids):
                key = (ids[last // pbt], last)
            elif last < prompt:
                key = (_UNIQUE, rid, i)
            else:
                key = (_UNIQUE, rid, i, sample)
            parent = hash((parent, key))
            append(parent)
            i += 1
        return hashes
    while i < num_full_blocks:
        last = (i + 1) * block_size - 1
        key = tuple(tokens[i * block_size:last + 1])
        if last >= prompt:
            # Sampled tokens are the sample's own: equal greedy samples must not share
            # blocks, or the engine would share what the simulator keeps apart.
            key = (key, seq.sample)
        parent = hash((parent, key))
        hashes.append(parent)
        i += 1
    return hashes
