"""Routers: which replica of a pool serves a request (simkv.config.cluster's policies).

- `round_robin`: the i-th arrival of the pool (0-based, arrival order, ties in trace order)
  goes to replica i mod N;
- `random`: a seeded uniform draw per arrival;
- `least_requests`: the replica holding the fewest requests (queued, running, swapped);
- `least_kv`: the lowest KV utilisation (used blocks / pool blocks), then fewest requests;
- `prefix_affinity`: consistent hashing of the prompt's first `prefix_blocks` trace prefix
  blocks (a later turn of a conversation hashes as its first turn), with bounded loads
  (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018): walk
  the ring from the key to the first replica holding fewer than ceil(load_factor x (requests
  + 1) / N) requests. Hashing only the first block would send every prompt of a trace whose
  prompts share a system prompt to one replica, hence k >= 2 by default;
- `kv_aware`: the highest score `prefix_weight x (prompt blocks cached on the replica / prompt
  blocks) + queue_weight x (1 - requests / most requests on any replica) + kv_weight x (free
  KV fraction)`, the weighted sum of a prefix-cache, a queue and a KV-utilisation scorer as
  llm-d's inference scheduler combines them; NVIDIA Dynamo's KV router likewise weighs the
  blocks a replica already holds against its load.

Ties go to the lowest replica index. The first two depend on the arrival order alone, so
their assignment is computed before the run (`assign`); the others read replica state as of
the router's last refresh (`refresh_s`; 0: live), except the prompt's cached blocks, which
`kv_aware` reads from each replica's prefix index when it routes (as a router fed with the
replicas' KV events sees them).
"""
from __future__ import annotations

import bisect
import hashlib
import math

import numpy as np

from simkv.config.cluster import STATE_INDEPENDENT
from simkv.engine.kv.hashing import extend_block_hashes, hash_root
from simkv.engine.request import Sequence

# routers that read a replica's KV blocks in use: a decode run commits its blocks at its end,
# so the fleet counts the blocks of a run's started steps as in use, and kv_aware's lookups
# count the cached ones among them as evicted (simkv.sim.cluster.fleet)
READS_KV = ("least_kv", "kv_aware")


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def assign(policy: str, arrivals_s: list, num_replicas: int, seed: int) -> list:
    """Replica index (0..num_replicas-1) of each request of a pool, in the order given, for a
    state-independent policy (round_robin, random)."""
    assert policy in STATE_INDEPENDENT
    order = np.argsort(np.asarray(arrivals_s, dtype=np.float64), kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    if policy == "round_robin":
        return (rank % num_replicas).tolist()
    draws = np.random.default_rng(seed).integers(0, num_replicas, size=len(order))
    return draws[rank].tolist()      # the i-th arrival takes the i-th draw


class Router:
    """Chooses a replica of one pool for each request, by `config.policy`.

    `replicas`: the pool's replicas (each with `scheduler`; `load` and `kv_used_fraction`
    read through `view`, which the fleet refreshes every `refresh_s`)."""

    def __init__(self, config, replicas: list, seed: int):
        self.config = config
        self.replicas = replicas
        self.policy = config.policy
        self.rng = np.random.default_rng(seed)
        self.next = 0
        self.snapshot = None                 # (loads, kv fractions) at the last refresh
        if self.policy == "prefix_affinity":
            points = sorted((_stable_hash(f"{r.name}#{v}"), i) for i, r in enumerate(replicas)
                            for v in range(config.virtual_nodes))
            self.ring_keys = [p for p, _ in points]
            self.ring_owner = [i for _, i in points]

    # -- what the router sees ------------------------------------------------------------------
    def refresh(self) -> None:
        """Take the replicas' loads as they are now (refresh_s > 0)."""
        self.snapshot = ([r.load() for r in self.replicas],
                         [r.kv_used_fraction() for r in self.replicas])

    def _loads(self) -> list:
        if self.snapshot is not None:
            return self.snapshot[0]
        return [r.load() for r in self.replicas]

    def _kv_fractions(self) -> list:
        if self.snapshot is not None:
            return self.snapshot[1]
        return [r.kv_used_fraction() for r in self.replicas]

    # -- choosing ------------------------------------------------------------------------------
    def choose(self, req, among=None) -> int:
        """The index (in the pool) of the replica to serve `req`; `among`: the indices allowed
        (default all)."""
        candidates = list(range(len(self.replicas))) if among is None else list(among)
        policy = self.policy
        if policy == "round_robin":
            pick = candidates[self.next % len(candidates)]
            self.next += 1
            return pick
        if policy == "random":
            return candidates[int(self.rng.integers(0, len(candidates)))]
        loads = self._loads()
        if policy == "least_requests":
            return min(candidates, key=lambda i: (loads[i], i))
        if policy == "least_kv":
            kv = self._kv_fractions()
            return min(candidates, key=lambda i: (kv[i], loads[i], i))
        if policy == "prefix_affinity":
            return self._ring_choice(req, candidates, loads)
        return self._kv_aware_choice(req, candidates, loads)

    def _ring_choice(self, req, candidates: list, loads: list) -> int:
        allowed = set(candidates)
        bound = math.ceil(self.config.load_factor * (sum(loads[i] for i in candidates) + 1)
                          / len(candidates))
        start = bisect.bisect_left(self.ring_keys, affinity_key(req, self.config.prefix_blocks))
        owners, n = self.ring_owner, len(self.ring_owner)
        first = None
        for step in range(n):
            owner = owners[(start + step) % n]
            if owner not in allowed:
                continue
            if first is None:
                first = owner
            if loads[owner] < bound:
                return owner
        return first

    def _kv_aware_choice(self, req, candidates: list, loads: list) -> int:
        c = self.config
        kv = self._kv_fractions()
        longest = max(max(loads[i] for i in candidates), 1)
        hits = cached_fractions(req, [self.replicas[i] for i in candidates])
        scores = [c.prefix_weight * h + c.queue_weight * (1 - loads[i] / longest)
                  + c.kv_weight * (1 - kv[i]) for i, h in zip(candidates, hits)]
        best = max(scores)
        return candidates[scores.index(best)]


def affinity_key(req, prefix_blocks: int) -> int:
    """The ring position of a request: its first `prefix_blocks` trace prefix blocks (their
    chained id names the whole prefix) with its tenant and adapter; a later turn takes its
    first turn's; without prefix ids, its own id (spread like a hash)."""
    while req.parent is not None:
        req = req.parent
    ids = req.prefix_ids
    if ids:
        ident = f"p{ids[min(prefix_blocks, len(ids)) - 1]}"
    else:
        ident = f"r{req.request_id}"
    return _stable_hash(f"{req.tenant}\x00{req.adapter}\x00{ident}")


def cached_fractions(req, replicas: list) -> list:
    """Per replica, the fraction of the prompt's full blocks (those a hit may cover) its
    prefix index holds now. The lookup changes nothing on the replica."""
    out = []
    probes: dict = {}
    for replica in replicas:
        scheduler = replica.scheduler
        kv = scheduler.kv
        bs = kv.block_size
        full = (req.prompt_tokens - 1) // bs
        if full <= 0:
            out.append(0.0)
            continue
        key = (bs, scheduler.global_prefix_scope)
        seq = probes.get(key)
        if seq is None:                 # one probe sequence per block size and scope
            req.hash_root = hash_root(req, scheduler.global_prefix_scope)
            seq = probes[key] = Sequence(-1, req, 0, req.prompt_tokens)
        else:
            req.hash_root = hash_root(req, scheduler.global_prefix_scope)
        evicted = replica.blocks_evicted_in_run() \
            if getattr(replica, "run_steps", None) is not None else None
        if evicted:
            tokens = _lookup_without(kv, seq, evicted)
        else:
            _, tokens = kv.prefix_lookup(seq)
        out.append(tokens / bs / full)
    return out


def hashed_among_first_free(pool, count: int) -> set:
    """The hashed blocks among the `count` that `pool.take(count)` would hand out next (the
    free queue's first live entries), which taking them would drop from the index."""
    out = set()
    if not count or not pool.num_cached_free:
        return out
    block_hash = pool.block_hash
    out.update(block for block in pool.free_queue.front(count) if block_hash[block] is not None)
    return out


def _lookup_without(kv, seq, evicted: set) -> int:
    """The tokens `kv.prefix_lookup(seq)` would hit once the blocks of `evicted` had left the
    index: a hash whose oldest block is gone answers with its next oldest still there (the
    index's rule for duplicates)."""
    if not kv.enable_prefix_caching or seq.num_computed_tokens:
        return 0
    bs = kv.block_size
    max_blocks = (seq.num_tokens - 1) // bs
    hashes = extend_block_hashes(seq, max_blocks, bs)
    cached, duplicates = kv.pool.cached, kv.pool.duplicates
    hits = 0
    for i in range(max_blocks):
        block = cached.get(hashes[i])
        if block is None:
            break
        if block in evicted and all(b in evicted for b in duplicates.get(hashes[i], ())):
            break
        hits += 1
    return hits * bs
