"""Chained block hashes for prefix caching.

Block i of a sequence is keyed by hash((hash of block i-1, identity of block i's tokens)); the chain
starts at a root built from the extra keys (tenant scope, adapter, multimodal identity), so that
requests that must not share never produce equal hashes.

Token identity comes from real token ids (engine) or, in simulation, from the trace's prefix ids:
a trace gives one chained id per `prefix_block_tokens` tokens, so equal ids at position k mean the
whole prompt up to the end of that trace block is equal. A simulator block is then identified by
the trace id covering its last token and that token's position. Tokens with no shared identity
(the rest of a prompt, sampled tokens) get keys unique to the request (and sample). Such a
block's hash is not chained: only the same request's block under the same root (a later turn
of the same tenant and adapter) can equal it, and that block's predecessors are equal too, so
chaining adds nothing. It is the integer -(2**64 * (i + 1) + h), with h a 64-bit hash of
(root, request id, sample or none), below every chained (64-bit) hash; a run of a sequence's
own blocks counts down by 2**64.

Turns (`Request.parent`): a prompt that continues an earlier request is its prompt, its output
(sample 0's) and new tokens, so a block that lies wholly inside the earlier request's prompt +
output has the key that request's block had, its prompt key or its sampled-token key, and so on
back through every earlier turn. vLLM needs no such rule: it hashes a full block's tokens
whether they were prompt or sampled (vllm/v1/core/kv_cache_utils.py, get_request_block_hasher).

Multimodal items (`Request.mm_spans`, (offset, length, key) each): a block that any item's
placeholder tokens overlap gets (key, offset - block start) per such item as an extra key, as
vLLM's _gen_mm_extra_hash_keys (vllm/v1/core/kv_cache_utils.py) does; blocks before the first
item are keyed as if there were none, so text before an image is shared across images.
`Request.mm_key`, when set, is one identity for the whole request and goes into the root.
"""
from __future__ import annotations

from itertools import count, islice

from simkv.engine.request import Request, Sequence, stable_key

_UNIQUE = -1   # marks a key unique to one request; trace ids and positions are never negative here


def hash_root(request: Request, global_scope: bool) -> int:
    """The chain's root for a request: tenant (unless sharing is global), adapter, multimodal key."""
    tenant = 0 if global_scope else stable_key(request.tenant)
    return hash((tenant, stable_key(request.adapter), stable_key(request.mm_key)))


def mm_extra_keys(mm_spans, start: int, end: int) -> tuple:
    """The multimodal extra keys of the block of tokens [start, end): (key, offset - start) for
    each item of `mm_spans` ((offset, length, key), sorted by offset) whose tokens
    [offset, offset + length) overlap it; () when none does."""
    return tuple((key, offset - start) for offset, length, key in mm_spans
                 if offset < end and start < offset + length)


def simulated_block_key(req: Request, i: int, sample: int, block_size: int):
    """The identity of block i (tokens [i * block_size, (i + 1) * block_size)) of sample
    `sample` of `req` in the simulator, which has no token ids: see the module docstring."""
    last = (i + 1) * block_size - 1
    turn = req.parent
    while turn is not None and last < turn.prompt_tokens + turn.output_tokens:
        req, sample, turn = turn, 0, turn.parent     # the block is the earlier turn's
    ids, pbt = req.prefix_ids, req.prefix_block_tokens
    if last >= req.prompt_tokens:
        key = (_UNIQUE, req.request_id, i, sample)
    elif ids is not None and last // pbt < len(ids):
        key = (ids[last // pbt], last)
    else:
        key = (_UNIQUE, req.request_id, i)
    if req.mm_spans:
        extra = mm_extra_keys(req.mm_spans, i * block_size, last + 1)
        if extra:
            key = (key, extra)
    return key


_BLOCK_STRIDE = 1 << 64         # unique hashes: -(stride * (i + 1) + h), h in [0, stride)


def unique_hashes(root: int, request_id: int, sample, start: int, stop: int):
    """The hashes of blocks start..stop-1 of a request's own tokens (sample None: its prompt's)
    under `root` (module docstring), in order: an iterator (counting down by the stride makes
    the integers faster than a range of them does)."""
    h = hash((root, request_id, sample)) & (_BLOCK_STRIDE - 1)
    return islice(count(-(_BLOCK_STRIDE * (start + 1) + h), -_BLOCK_STRIDE), stop - start)


def simulated_block_hash(root, parent, key):
    """The hash of a simulator block with key `key` after a block hashed `parent` in a chain
    from `root`: chained, or for a key unique to its request not chained (module docstring)."""
    if key[0] == _UNIQUE:
        i = key[2]
        return next(unique_hashes(root, key[1], key[3] if len(key) > 3 else None, i, i + 1))
    return hash((parent, key))


def extend_block_hashes(seq: Sequence, num_full_blocks: int, block_size: int) -> list:
    """Grow `seq.block_hashes` to cover its first `num_full_blocks` full blocks; returns the list."""
    hashes = seq.block_hashes
    i = len(hashes)
    if i >= num_full_blocks:
        return hashes
    req = seq.request
    tokens = seq.token_ids
    prompt = req.prompt_tokens
    if i * block_size > prompt and tokens is None and req.parent is None and not req.mm_spans:
        # The block before holds an output token, so it is the sample's own (keyed unique,
        # simulated_block_key) and these go on from its hash as unique_hashes counts (the
        # common decode: one block at a time).
        h = hashes[-1]
        for _ in range(num_full_blocks - i):
            h -= _BLOCK_STRIDE
            hashes.append(h)
        return hashes
    parent = hashes[-1] if hashes else req.hash_root
    append = hashes.append
    root = req.hash_root
    if tokens is None and (req.parent is not None or req.mm_spans):
        sample = seq.sample
        while i < num_full_blocks:
            parent = simulated_block_hash(root, parent,
                                          simulated_block_key(req, i, sample, block_size))
            append(parent)
            i += 1
        return hashes
    ids = req.prefix_ids
    pbt = req.prefix_block_tokens
    if tokens is None:              # the simulator: simulated_block_key, written out for speed
        prompt_blocks = prompt // block_size          # blocks wholly inside the prompt
        if ids is not None:         # the shared blocks first: those the trace's ids cover
            shared = min(num_full_blocks, prompt_blocks, len(ids) * pbt // block_size)
            while i < shared:
                last = (i + 1) * block_size - 1
                parent = hash((parent, (ids[last // pbt], last)))
                append(parent)
                i += 1
        rid = req.request_id
        if i < num_full_blocks and i < prompt_blocks:          # the prompt's own blocks
            end = min(num_full_blocks, prompt_blocks)
            hashes.extend(unique_hashes(root, rid, None, i, end))
            i = end
        if i < num_full_blocks:                                  # the sample's own blocks
            hashes.extend(unique_hashes(root, rid, seq.sample, i, num_full_blocks))
        return hashes
    mm_spans = req.mm_spans
    while i < num_full_blocks:
        last = (i + 1) * block_size - 1
        key = tuple(tokens[i * block_size:last + 1])
        if last >= prompt:
            # Sampled tokens are the sample's own: equal greedy samples must not share
            # blocks, or the engine would share what the simulator keeps apart.
            key = (key, seq.sample)
        if mm_spans:
            extra = mm_extra_keys(mm_spans, i * block_size, last + 1)
            if extra:
                key = (key, extra)
        parent = hash((parent, key))
        append(parent)
        i += 1
    return hashes
