"""Cost features that the plan does not carry: what the step's decodes read again, and what a
mixture-of-experts step touches.

A KV block that several of a step's decode tables hold is read once from HBM and again from L2
(simkv.costmodel.shared_reads). How many repeats a step has depends on the KV manager's
reference counts at the time the step runs, so the simulator's executor counts them from the
plan and a read-only view of the KV manager and the running requests; the real engine never
needs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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


# ----------------------------------------------------------------------------------------------
# Mixture of experts: how many distinct experts a step's tokens are routed to, and what follows.
#
# Every token of a step passes every MoE layer and picks top_k of its num_experts routed
# experts. Under uniform routing a given expert is missed by one token with probability
# 1 - k/E, by all T tokens of the step (routed independently) with (1 - k/E)^T, so a layer
# touches, in expectation,
#     E x (1 - (1 - k/E)^T)
# distinct experts: k at T = 1, nearly all of them once T x k is a few times E. Real routers are
# not uniform; `skew` s >= 0 gives expert e (0-based) a popularity proportional to (e + 1)^-s
# (Zipf; s = 0 is uniform), and a token includes expert e with probability q_e = min(1, c x
# popularity_e), c chosen so that the q_e sum to k (each token picks k experts). The expected
# count is then sum_e 1 - (1 - q_e)^T, which is the closed form above when s = 0. The count
# depends only on each token's inclusion probabilities, not on how the k picks are drawn.


def expert_inclusion_probabilities(num_experts: int, top_k: int, skew: float = 0.0) -> list:
    """The probability that one token is routed to each expert, most popular first (sum top_k):
    popularity (e + 1)^-skew, scaled and capped at 1 (the capped experts take one pick each and
    the rest share what is left in proportion)."""
    if skew == 0.0:
        return [top_k / num_experts] * num_experts
    weights = [(e + 1) ** -skew for e in range(num_experts)]
    for capped in range(top_k + 1):           # the `capped` most popular are certain
        rest = sum(weights[capped:])
        scale = (top_k - capped) / rest if rest else 0.0
        if capped == num_experts or weights[capped] * scale <= 1.0:
            return [1.0] * capped + [w * scale for w in weights[capped:]]
    raise AssertionError("unreachable: top_k <= num_experts caps at most top_k experts")


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int,
                             skew: float = 0.0) -> float:
    """Expected distinct routed experts one MoE layer runs for `num_tokens` routed tokens
    (uniform routing when skew is 0: num_experts x (1 - (1 - top_k/num_experts)^num_tokens))."""
    if num_tokens <= 0:
        return 0.0
    if skew == 0.0:
        return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
    return math.fsum(1.0 - (1.0 - q) ** num_tokens
                     for q in expert_inclusion_probabilities(num_experts, top_k, skew))


def routed_tokens(plan) -> int:
    """Tokens a step sends through its MoE layers: every prefill and decode token."""
    return plan.num_prefill_tokens + plan.num_decode_tokens


@dataclass(frozen=True)
class MoeStep:
    """A step's mixture-of-experts quantities (per step, all MoE layers together unless named)."""

    routed_tokens: int
    experts_touched: float          # expected distinct routed experts, per MoE layer
    expert_bytes_read: float        # routed-expert weight bytes read: touched x layers x bytes
    active_expert_bytes: float      # what a dense model of the active size reads: top_k
                                    # experts per layer, whatever the batch
    expert_flops: float             # routed-expert FLOPs: 2 x params of k experts per token


def moe_step(plan, model, skew: float = 0.0) -> MoeStep:
    """The step's MoE features for `model` (a simkv.specs.ModelSpec with experts)."""
    e = model.experts
    tokens = routed_tokens(plan)
    touched = expected_experts_touched(e.num_experts, e.top_k, tokens, skew)
    per_layer = model.expert_bytes * e.num_moe_layers
    return MoeStep(
        routed_tokens=tokens, experts_touched=touched,
        expert_bytes_read=touched * per_layer,
        active_expert_bytes=e.top_k * per_layer,
        expert_flops=2.0 * e.top_k * model.expert_params * e.num_moe_layers * tokens)
