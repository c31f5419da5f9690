"""Deterministic prompt token ids for traces that give prefix identities instead of tokens.

A trace says which prompts share a prefix through chained ids, one per `prefix_block_tokens`
tokens (equal ids at position k mean the prompts are equal up to the end of trace block k). The
real engine needs token ids, so trace block k gets tokens drawn from a generator seeded by its
id alone: equal ids give equal tokens, hence equal block hashes in the engine's prefix cache,
exactly where the simulator (which hashes the ids) sees sharing. Tokens not covered by an id
are drawn from a generator seeded by the request id, so they are the request's own.

Pure numpy: no torch, no simpy.
"""
from __future__ import annotations

import numpy as np

_PREFIX_STREAM = 0x5052_4546   # "PREF": keeps prefix-id streams apart from request streams
_REQUEST_STREAM = 0x5245_5153  # "REQS"
_MASK64 = (1 << 64) - 1


def _draw(vocab_size: int, count: int, *key: int) -> np.ndarray:
    """`count` token ids in [0, vocab_size) from a generator seeded by `key` (ints)."""
    rng = np.random.default_rng([k & _MASK64 for k in key])
    return rng.integers(0, vocab_size, size=count, dtype=np.int64)


def prompt_token_ids(request, vocab_size: int, seed: int = 0) -> list:
    """The prompt's token ids (a list of `request.prompt_tokens` ints in [0, vocab_size)).

    Trace block k (tokens [k*B, (k+1)*B) with B = `request.prefix_block_tokens`) is a function
    of `(seed, prefix_ids[k])` only; a partial last block is a prefix of the full block's
    tokens. The rest of the prompt is a function of `(seed, request_id)`.
    """
    prompt = request.prompt_tokens
    ids = request.prefix_ids or ()
    block = request.prefix_block_tokens
    tokens = np.empty(prompt, dtype=np.int64)
    covered = 0
    if ids and block > 0:
        for k, prefix_id in enumerate(ids):
            start = k * block
            if start >= prompt:
                break
            end = min(start + block, prompt)
            tokens[start:end] = _draw(vocab_size, block, seed, _PREFIX_STREAM, int(prefix_id))[:end - start]
            covered = end
    if covered < prompt:
        tokens[covered:] = _draw(vocab_size, prompt - covered, seed, _REQUEST_STREAM,
                                 int(request.request_id))
    return tokens.tolist()


def assign_prompt_tokens(requests, vocab_size: int, seed: int = 0) -> None:
    """Set `prompt_token_ids` on every request that has none (in place)."""
    for req in requests:
        if req.prompt_token_ids is None:
            req.prompt_token_ids = prompt_token_ids(req, vocab_size, seed)
