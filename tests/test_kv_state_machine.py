"""A Hypothesis state machine drives the paged KV manager the way a scheduler would (issue 3).

Rules: arrive, admit (prefix lookup + all-or-nothing allocation of every sequence of a request,
or of the first sample only, the others re-forking from it as the scheduler does after a
recompute), grow (a prefill chunk or a decode append; n > 1 forks when its prompt is done),
finish one sample, swap out, swap in, cancel, preempt for recompute, and the two ways a
scheduler gives slots back uncomputed (an admission rolled back; a request preempted in the step
that scheduled it). After every step `check_integrity` must hold, and so must a content oracle: the test keeps, for every device and host block, which token each slot holds
(written when tokens are computed, copied by copy-on-write, moved by swaps), and every live
sequence must find its own tokens at every computed position of its table. A wrong prefix hit, a
write into a shared block, a wrong swap mapping or a cross-tenant share all break it. Each run
ends by freeing everything: every block free, every refcount zero, the host pool empty.

Prompts come from a few shared-prefix families (chained trace ids, as a trace gives them), two
tenants and two adapters, on a pool small enough that allocations fail, blocks are evicted and
the host pool fills up.
"""
import os

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from simkv.engine.kv.hashing import hash_root
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.request import Request, Sequence

BS = 4
NUM_BLOCKS = 14
NUM_HOST_BLOCKS = 8
MAX_LIVE = 6            # live requests at once
MAX_TOKENS = 56         # a sequence stops growing here
FAMILY_BLOCK_TOKENS = {0: 4, 1: 8}   # trace granularity per prefix family (re-chunked to BS)


def token(seq, pos):
    """What sits at `pos` of `seq`: equal for two sequences iff they may share that slot.

    The samples of an n > 1 request are forked when the prompt is done, after the first output
    token was sampled, so they share it; later outputs are their own."""
    req = seq.request
    if pos < req.prompt_tokens:
        ids, pbt = req.prefix_ids, req.prefix_block_tokens
        if ids is not None and pos // pbt < len(ids):
            return ("shared", req.hash_root, ids[pos // pbt], pos)
        return ("prompt", req.request_id, pos)
    if pos == req.prompt_tokens:
        return ("first output", req.request_id)
    return ("output", req.request_id, seq.sample, pos)


class PagedKVMachine(RuleBasedStateMachine):
    enable_prefix_caching = True
    global_scope = False
    watermark = 0.1

    def __init__(self):
        super().__init__()
        self.kv = PagedKVCacheManager(NUM_BLOCKS, BS, self.enable_prefix_caching,
                                      watermark=self.watermark, num_host_blocks=NUM_HOST_BLOCKS)
        self.device: dict = {}      # block -> {slot: token}
        self.host: dict = {}
        self.waiting: list = []     # requests holding nothing (new, or preempted for recompute)
        self.running: list = []
        self.swapped: list = []
        self.next_id = 0
        self.unique_id = 10 ** 6

    # -- helpers --------------------------------------------------------------------------------
    def live(self):
        return self.waiting + self.running + self.swapped

    @staticmethod
    def pick(data, items):
        """Draw an element by index (short, readable failure reports)."""
        return items[data.draw(st.integers(0, len(items) - 1))]

    def snapshot(self):
        kv, pool = self.kv, self.kv.pool
        return (list(pool.ref_cnt), list(pool.free_queue), dict(pool.cached),
                pool.num_cached_free, list(kv.host.ref_cnt), list(kv.host.free),
                {sid: (list(s.block_table), s.host_table and list(s.host_table), s.num_cached_blocks)
                 for sid, s in kv.seqs.items()})

    def apply_copies(self):
        for src, dst in self.kv.take_copies():
            self.device[dst] = dict(self.device.get(src, {}))

    def compute(self, seq, start, end):
        """Tokens [start, end) of `seq` are computed; a finished prefill or decode samples one."""
        table = seq.block_table
        for pos in range(start, end):
            self.device.setdefault(table[pos // BS], {})[pos % BS] = token(seq, pos)
        seq.num_computed_tokens = end
        req = seq.request
        waiting = self.waiting_to_refork(req)
        if waiting and end >= req.prompt_tokens:     # the scheduler's re-fork after recompute
            for child in waiting:
                self.kv.fork(seq, child, req.prompt_tokens)
                child.num_computed_tokens = req.prompt_tokens
        if end == seq.num_tokens:
            seq.num_tokens += 1
            if req.n > 1 and len(req.all_seqs) == 1:   # as the scheduler does: fork at once
                self.fork(seq)

    @staticmethod
    def waiting_to_refork(req):
        """Samples of a recomputed request waiting for the first one to have the prompt."""
        return [s for s in req.seqs[1:]
                if s.num_computed_tokens == 0 and not s.block_table and not s.host_table]

    def fork(self, parent):
        req = parent.request
        free = self.kv.num_free_blocks
        for sample in range(1, req.n):
            child = self.new_seq(req, sample, parent.num_tokens, parent.num_computed_tokens)
            self.kv.fork(parent, child)
            assert child.block_table == parent.block_table
        assert self.kv.num_free_blocks == free    # a fork allocates nothing

    def new_seq(self, req, sample, num_tokens, computed=0):
        seq = Sequence(self.next_id, req, sample, num_tokens, num_computed_tokens=computed)
        self.next_id += 1
        req.seqs.append(seq)
        req.all_seqs.append(seq)
        return seq

    def release(self, req):
        for seq in req.seqs:
            self.kv.free(seq)

    # -- rules ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(prompt=st.integers(1, 40), family=st.sampled_from([None, 0, 1]),
          shared_ids=st.integers(0, 10), tenant=st.sampled_from(["a", "b"]),
          adapter=st.sampled_from(["", "", "x"]), n=st.integers(1, 3))
    def arrive(self, prompt, family, shared_ids, tenant, adapter, n):
        ids, pbt = None, 0
        if family is not None:         # chained ids: equal at j implies equal before j
            pbt = FAMILY_BLOCK_TOKENS[family]
            ids = []
            for j in range(-(-prompt // pbt)):
                if j < shared_ids:
                    ids.append(1000 * family + j)
                else:
                    self.unique_id += 1
                    ids.append(self.unique_id)
            ids = tuple(ids)
        req = Request(self.next_id, 0.0, prompt, 8, n=n, prefix_ids=ids, prefix_block_tokens=pbt,
                      tenant=tenant, adapter=adapter)
        req.hash_root = hash_root(req, self.global_scope)
        self.new_seq(req, 0, prompt)
        self.waiting.append(req)

    def allocate_request(self, seqs, chunk, admission):
        """Admission: a lookup and an allocation per sequence, all of them or none (rolled back,
        the last admitted first). Returns [(seq, cached, num_new)] or None; hits count as
        computed at once."""
        kv = self.kv
        before = self.snapshot()
        admitted = []
        for seq in seqs:
            hits, cached = kv.prefix_lookup(seq)
            assert cached == len(hits) * BS and cached < seq.num_tokens
            num_new = min(chunk, seq.num_tokens - cached)
            if not kv.allocate_slots(seq, num_new, hits, admission=admission):
                break
            seq.num_computed_tokens += cached
            admitted.append((seq, cached, num_new))
        if len(admitted) == len(seqs):
            return admitted
        self.roll_back(admitted)
        if not admitted:
            assert self.snapshot() == before
        return None

    def roll_back(self, admitted):
        for seq, cached, _ in reversed(admitted):
            self.kv.free(seq)
            seq.num_computed_tokens -= cached
        self.kv.take_copies()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 48), admission=st.booleans(),
          first_only=st.booleans())
    def admit(self, data, chunk, admission, first_only):
        """A recomputed n > 1 request is admitted either all at once, or (as the scheduler
        does) by its first sample, the others re-forking from it once it has the prompt."""
        req = self.pick(data, self.waiting)
        admitted = self.allocate_request(req.seqs[:1] if first_only else req.seqs, chunk,
                                         admission)
        if admitted is None:
            return
        self.apply_copies()
        for seq, cached, num_new in admitted:
            self.compute(seq, cached, cached + num_new)
        self.waiting.remove(req)
        self.running.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 48))
    def admit_then_roll_back(self, data, chunk):
        """Slots allocated and given back uncomputed, as when a later sequence of the request
        does not fit: nothing of it may be hit afterwards."""
        req = self.pick(data, self.waiting)
        admitted = self.allocate_request(req.seqs, chunk, False)
        if admitted is not None:
            self.roll_back(admitted)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def schedule_then_preempt(self, data, chunk):
        """Slots allocated for a step, then the request is preempted in that same step (the
        priority policy can pick a request it already scheduled): they are never computed."""
        req = self.pick(data, self.running)
        for seq in req.seqs:
            if seq in self.waiting_to_refork(req):
                continue
            num_new = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if seq.num_tokens >= MAX_TOKENS or not self.kv.allocate_slots(seq, num_new):
                break
        self.apply_copies()                   # the executor still performs the step's copies
        self.release(req)
        for seq in req.seqs:
            seq.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def grow(self, data, chunk):
        req = self.pick(data, self.running)
        seq = self.pick(data, [s for s in req.seqs if s not in self.waiting_to_refork(req)])
        if seq.num_tokens >= MAX_TOKENS:
            return
        start = seq.num_computed_tokens
        num_new = min(chunk, seq.num_tokens - start)
        before = self.snapshot()
        if not self.kv.allocate_slots(seq, num_new):
            assert self.snapshot() == before     # all or nothing
            return
        self.apply_copies()
        self.compute(seq, start, start + num_new)

    @precondition(lambda self: any(not self.waiting_to_refork(r) for r in self.running))
    @rule(data=st.data())
    def finish_sample(self, data):
        req = self.pick(data, [r for r in self.running if not self.waiting_to_refork(r)])
        seq = self.pick(data, req.seqs)
        self.kv.free(seq)
        req.seqs.remove(seq)
        if not req.seqs:
            self.running.remove(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        req = self.pick(data, self.running)
        before = self.snapshot()
        mapping = self.kv.swap_out(req.seqs)
        if mapping is None:
            assert self.snapshot() == before
            return
        assert len({d for d, _ in mapping}) == len(mapping) == len({h for _, h in mapping})
        for device_block, host_block in mapping:
            self.host[host_block] = dict(self.device.get(device_block, {}))
        self.running.remove(req)
        self.swapped.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        req = self.pick(data, self.swapped)
        before = self.snapshot()
        mapping = self.kv.swap_in(req.seqs)
        if mapping is None:
            assert self.snapshot() == before
            return
        for host_block, device_block in mapping:
            self.device[device_block] = dict(self.host[host_block])
        self.swapped.remove(req)
        self.running.append(req)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def cancel(self, data):
        req = self.pick(data, self.live())
        self.release(req)
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_for_recompute(self, data):
        req = self.pick(data, self.running)
        self.release(req)
        for seq in req.seqs:
            seq.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    # Rules are chosen uniformly; these aliases weight the ones that make a small pool contend
    # (and so exercise failed allocations, rollbacks, evictions and re-admission hits).
    admit_more = admit
    grow_more = grow
    preempt_more = preempt_for_recompute

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def integrity_holds(self):
        self.kv.check_integrity()
        assert self.kv.copies == []

    @invariant()
    def every_sequence_finds_its_own_tokens(self):
        for req in self.running:
            for seq in req.seqs:
                table = seq.block_table
                assert seq.host_table is None
                assert len(table) == len(set(table)) >= -(-seq.num_computed_tokens // BS)
                for pos in range(seq.num_computed_tokens):
                    assert self.device[table[pos // BS]].get(pos % BS) == token(seq, pos), \
                        f"seq {seq.seq_id} position {pos}"
        for req in self.swapped:
            for seq in req.seqs:
                assert seq.block_table == []
                for pos in range(seq.num_computed_tokens):
                    assert self.host[seq.host_table[pos // BS]].get(pos % BS) == token(seq, pos)
        for req in self.waiting:
            assert all(s.block_table == [] and s.seq_id not in self.kv.seqs for s in req.seqs)

    @invariant()
    def shared_blocks_never_cross_scopes(self):
        holders: dict = {}
        for seq in self.kv.seqs.values():
            req = seq.request
            scope = (req.adapter,) if self.global_scope else (req.tenant, req.adapter)
            for block in seq.block_table:
                assert holders.setdefault(block, scope) == scope, f"block {block} shared"

    def teardown(self):
        for req in self.live():
            self.release(req)
        kv = self.kv
        kv.check_integrity()
        assert kv.seqs == {}
        assert kv.num_free_blocks == NUM_BLOCKS and all(r == 0 for r in kv.pool.ref_cnt)
        assert len(kv.host.free) == NUM_HOST_BLOCKS and all(r == 0 for r in kv.host.ref_cnt)


class NoPrefixCachingMachine(PagedKVMachine):
    enable_prefix_caching = False


class GlobalScopeMachine(PagedKVMachine):
    global_scope = True
    watermark = 0.0


# 100 runs of up to 50 steps per machine in CI (about 14,000 steps in all); longer:
# SIMKV_KV_MACHINE_EXAMPLES=5000 python -m pytest -q tests/test_kv_state_machine.py
SETTINGS = settings(max_examples=int(os.environ.get("SIMKV_KV_MACHINE_EXAMPLES", "100")),
                    stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TestPrefixCaching = PagedKVMachine.TestCase
TestPrefixCaching.settings = SETTINGS
TestNoPrefixCaching = NoPrefixCachingMachine.TestCase
TestNoPrefixCaching.settings = SETTINGS
TestGlobalPrefixScope = GlobalScopeMachine.TestCase
TestGlobalPrefixScope.settings = SETTINGS
