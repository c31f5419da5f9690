"""Fixed-shape steps over static input buffers, replayed as CUDA graphs (the executor's fast path).

    steps = GraphSteps(executor)      # buffers for every captured size
    steps.capture()                   # on CUDA: one graph per size, sharing one memory pool
    tokens, prep_s = steps.run_decode(single)           # decode-only step
    tokens, prep_s = steps.run_mixed(prefill, single, steps.mixed_bucket(...))

Decode-only steps are captured at bucketed batch sizes (GRAPH_BATCH_SIZES up to max_num_seqs),
steps with prefill chunks at bucketed token counts (MIXED_TOKEN_SIZES up to 2,048 and
max_num_batched_tokens). A graph reads its inputs from buffers at fixed addresses, which every
step updates in place; the padding of a bucket is inert (slot -1 writes nothing, a decode row of
sequence length 0 and a prefill sequence with no new tokens are skipped by the kernels).

With KV cache groups (a window hybrid: GpuExecutor `kv_groups`) the buffers hold a slot mapping
and block tables per group, each group's table laid out as the eager step lays it out
(`step_inputs.group_tables`: a window group's freed leading entries 0), and the model's
`AttentionMetadata.groups` point at them; the sequence lengths and query offsets are the step's,
shared by every group.

The mixed layout puts the decode tokens first (rows [0, D)), then the chunks' tokens, then
padding: the decode kernel covers rows [0, d_cap) and the prefill kernel every row by its
`query_start_loc`, so one graph serves any split of its token count between decodes and chunks
(`AttentionMetadata.fixed_shape`). Without graphs (`use_graphs` off: CPU tests) the same step
functions run directly over the same buffers.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from simkv.launch_policy import decode_graph_sizes, mixed_graph_sizes
from simkv.gpu.attention import AttentionMetadata
from simkv.gpu.step_inputs import group_host_inputs, host_inputs


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GraphSteps:
    """The static buffers, step functions and captured graphs of one GpuExecutor."""

    def __init__(self, executor):
        self.ex = executor
        self.use_graphs = executor.use_graphs
        self.decode_graphs: dict = {}      # batch size -> (graph, logits, tokens)
        self.mixed_graphs: dict = {}       # token count -> (graph, logits, tokens)
        self.width = _cdiv(executor.max_model_len, executor.block_size)   # table columns
        self.group_is_full = executor.group_is_full     # per KV cache group; [] without groups
        self.num_tables = max(1, len(self.group_is_full))   # block tables (and slot mappings)
        windows = {w for w, f in zip(executor.group_windows, self.group_is_full) if w and not f}
        self._window_groups = [([g for g, w in enumerate(executor.group_windows)
                                 if w == window and not self.group_is_full[g]], window)
                               for window in sorted(windows)]
        # id(seq) -> (seq, its block_table, key, `_group_array`); pruned at `_prune_at` entries
        self._group_arrays: dict = {}
        self._prune_at = 4 * executor.max_num_seqs
        self._has_full_group = any(self.group_is_full)   # its tables do not depend on `used`
        self._decode_buffers()
        self._mixed_buffers()

    # -- sizes --------------------------------------------------------------------------------
    def decode_buckets(self) -> list:
        return decode_graph_sizes(self.ex.max_num_seqs)

    def mixed_buckets(self) -> list:
        return mixed_graph_sizes(self.ex.max_num_batched_tokens)

    def mixed_caps(self, tokens: int) -> tuple:
        """(decode rows, prefill sequences, sampled rows) a mixed step of `tokens` can hold: a
        prefill chunk has >= 2 tokens (a 1-token chunk runs as a decode row)."""
        cap = min(tokens, self.ex.max_num_seqs)
        return cap, max(1, min(tokens // 2, self.ex.max_num_seqs)), cap

    def mixed_bucket(self, num_prefill_seqs: int, num_decodes: int, tokens: int):
        """The captured token count a step with chunks fits, or None (then it runs eagerly)."""
        for t in self.mixed_buckets():
            if t >= tokens:
                d_cap, p_cap, r_cap = self.mixed_caps(t)
                if num_decodes <= d_cap and num_prefill_seqs <= p_cap and \
                        num_decodes + num_prefill_seqs <= r_cap:
                    return t
                return None
        return None

    # -- buffers and step functions -----------------------------------------------------------
    def _decode_buffers(self) -> None:
        """Static inputs of the decode graphs, and the split-K workspace every graph shares."""
        ex = self.ex
        dev, spec, width, n_t = ex.device, ex.spec, self.width, self.num_tables
        top = self.decode_buckets()[-1]
        pinned = dev.type == "cuda"
        # ids, positions, then each block table's slots
        self.g_i64 = torch.zeros((2 + n_t, top), dtype=torch.int64, device=dev)
        self.g_i64[2:].fill_(-1)          # warm-up and capture write nothing into the cache
        self.g_seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.g_tables = torch.zeros((n_t, top, width), dtype=torch.int32, device=dev)
        self.g_tables_stage = torch.empty(n_t * top * width, dtype=torch.int32, device=dev)
        self.h_i64 = torch.zeros((2 + n_t, top), dtype=torch.int64, pin_memory=pinned)
        self.h_seq_lens = torch.ones(top, dtype=torch.int32, pin_memory=pinned)
        self.h_tables = torch.zeros(n_t * top * width, dtype=torch.int32, pin_memory=pinned)
        self.workspace = None
        if ex.attention == "triton" and dev.type == "cuda":
            from simkv.gpu import kernels
            cfg = kernels.decode_config(ex.block_size, spec.head_dim, ex.dtype)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            rows = set(self.decode_buckets()) | {self.mixed_caps(t)[0]
                                                 for t in self.mixed_buckets()}
            need = max(kernels.decode_workspace_numel(
                b, spec.num_heads, spec.head_dim,
                kernels.decode_num_splits(b, spec.num_kv_heads, width * ex.block_size,
                                          cfg.tile, sms)) for b in rows)
            self.workspace = torch.empty(max(need, 1), dtype=torch.float32, device=dev)

    def _mixed_buffers(self) -> None:
        """Static inputs of the mixed-step graphs, sized for the largest captured token count."""
        dev, width, n_t = self.ex.device, self.width, self.num_tables
        top = self.mixed_buckets()[-1]
        d_cap, p_cap, r_cap = self.mixed_caps(top)
        pinned = dev.type == "cuda"
        # ids, positions, then each block table's slots
        self.m_i64 = torch.zeros((2 + n_t, top), dtype=torch.int64, device=dev)
        self.m_i64[2:].fill_(-1)
        self.m_rows = torch.zeros(r_cap, dtype=torch.int64, device=dev)
        # int32: decode seq_lens [d_cap], prefill query_start_loc [p_cap + 1], seq_lens [p_cap]
        self.m_i32 = torch.zeros(d_cap + 2 * p_cap + 1, dtype=torch.int32, device=dev)
        self.m_dec_tables = torch.zeros((n_t, d_cap, width), dtype=torch.int32, device=dev)
        self.m_pf_tables = torch.zeros((n_t, p_cap, width), dtype=torch.int32, device=dev)
        self.m_tables_stage = torch.empty(n_t * (d_cap + p_cap) * width, dtype=torch.int32,
                                          device=dev)
        self.hm_i64 = torch.zeros((2 + n_t, top), dtype=torch.int64, pin_memory=pinned)
        self.hm_rows = torch.zeros(r_cap, dtype=torch.int64, pin_memory=pinned)
        self.hm_i32 = torch.zeros(d_cap + 2 * p_cap + 1, dtype=torch.int32, pin_memory=pinned)
        self.hm_tables = torch.zeros(n_t * (d_cap + p_cap) * width, dtype=torch.int32,
                                     pin_memory=pinned)
        self.m_caps = (d_cap, p_cap, r_cap)

    def decode_step(self, b: int):
        """The decode step of batch `b` over the static buffers: returns (logits, tokens)."""
        meta = AttentionMetadata(slot_mapping=self.g_i64[2, :b], num_prefill_tokens=0,
                                 decode_block_tables=self.g_tables[0, :b],
                                 decode_seq_lens=self.g_seq_lens[:b],
                                 decode_workspace=self.workspace)
        if self.group_is_full:
            meta.groups = [AttentionMetadata(slot_mapping=self.g_i64[2 + g, :b],
                                             decode_block_tables=self.g_tables[g, :b])
                           for g in range(self.num_tables)]
        ex = self.ex

        def step():
            logits = ex.model.forward(self.g_i64[0, :b], self.g_i64[1, :b], meta, ex.caches)
            return logits, logits.argmax(-1)
        return step

    def mixed_step(self, tokens: int):
        """The mixed step of `tokens` rows over the static buffers: returns (logits, tokens)."""
        d_cap, p_cap, r_cap = self.mixed_caps(tokens)
        top_d, top_p, _ = self.m_caps
        i32 = self.m_i32
        meta = AttentionMetadata(
            slot_mapping=self.m_i64[2, :tokens], num_prefill_tokens=0, fixed_shape=True,
            decode_block_tables=self.m_dec_tables[0, :d_cap], decode_seq_lens=i32[:d_cap],
            prefill_query_start_loc=i32[top_d:top_d + p_cap + 1],
            prefill_seq_lens=i32[top_d + top_p + 1:top_d + top_p + 1 + p_cap],
            prefill_block_tables=self.m_pf_tables[0, :p_cap], decode_workspace=self.workspace)
        if self.group_is_full:
            meta.groups = [AttentionMetadata(slot_mapping=self.m_i64[2 + g, :tokens],
                                             decode_block_tables=self.m_dec_tables[g, :d_cap],
                                             prefill_block_tables=self.m_pf_tables[g, :p_cap])
                           for g in range(self.num_tables)]
        ex = self.ex

        def step():
            logits = ex.model.forward(self.m_i64[0, :tokens], self.m_i64[1, :tokens], meta,
                                      ex.caches, self.m_rows[:r_cap])
            return logits, logits.argmax(-1)
        return step

    def capture(self) -> None:
        """Capture every size as a CUDA graph, largest first so that the others reuse its
        memory pool (the mixed steps are the largest)."""
        dev = self.ex.device
        pool = torch.cuda.graph_pool_handle()
        todo = [(self.mixed_graphs, t, self.mixed_step(t)) for t in reversed(self.mixed_buckets())]
        todo += [(self.decode_graphs, b, self.decode_step(b))
                 for b in reversed(self.decode_buckets())]
        for graphs, key, step in todo:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):        # compiles every kernel this shape needs
                    step()
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                logits, tokens = step()
            graphs[key] = (graph, logits, tokens)
        torch.cuda.synchronize(dev)

    def _replay(self, graphs: dict, key: int, make_step):
        """Replay the captured graph `key`, or (static inputs without graphs) run its step."""
        if self.use_graphs:
            graph, logits, tokens = graphs[key]
            graph.replay()
            return logits, tokens
        return make_step(key)()

    # -- running a step -----------------------------------------------------------------------
    def _decode_width(self, single: list) -> int:
        """Block-table columns the decode rows of `single` need (at least 1)."""
        bs = self.ex.block_size
        return max([it.start // bs + 1 for it in single] or [1])

    def _write_decode_rows(self, single: list, h, lens, tables, kv=None) -> None:
        """Write one-token decode items into rows [0, len(single)) of the host arrays (ids,
        positions, each block table's slots into `h`; sequence lengths into `lens`; block
        tables into `tables` [num_tables, len(single), `_decode_width`]). `kv`: the KV manager,
        whose `group_blocks_of` splits a sequence's blocks by group (KV cache groups)."""
        bs, full = self.ex.block_size, self.group_is_full
        for j, it in enumerate(single):
            seq, p = it.seq, it.start
            h[0, j] = seq.token_ids[p]
            h[1, j] = p
            lens[j] = p + 1
            if full:
                self._write_group_row(seq, kv, p, j, h, tables)
            else:
                table = seq.block_table
                h[2, j] = table[p // bs] * bs + p % bs
                tables[0, j, :p // bs + 1] = table[:p // bs + 1]

    def _write_group_row(self, seq, kv, p: int, j: int, h, tables) -> None:
        """Row j of every group's table and slot mapping for the decode at position `p`: the
        layout of `step_inputs.group_tables` (a window group's freed leading entries 0), copied
        from the sequence's `_group_array` in one operation for the tables and one for the
        slots. `kv` None (no KV manager): every group uses the whole table, a window group's
        entries before its window 0, as `group_tables` has them."""
        bs = self.ex.block_size
        used = p // bs + 1
        rows = self._group_array(seq, kv, used)
        if kv is None:
            tables[:, j, :used] = rows[:used]
            for groups, window in self._window_groups:
                lead = min(max(0, p - window + 1) // bs, used)
                if lead:
                    tables[groups, j, :lead] = 0
            h[2:, j] = rows[p // bs] * bs + p % bs
        else:
            tables[:, j, :used] = rows[:, :used]
            h[2:, j] = rows[:, p // bs] * bs + p % bs

    def _group_array(self, seq, kv, used: int) -> np.ndarray:
        """The sequence's block table as an int64 array, kept while `seq.block_table` is the
        same list. With a KV manager [num_tables, entries]: each group's table as
        `step_inputs.group_tables` lays it out (as many entries as a full group's, a window
        group's freed leading ones 0); without one the table itself. HybridKVCacheManager
        assigns a new list whenever a sequence's blocks change, never edits one in place, and
        the profiler's sequences keep theirs; so a step reads a sequence's block ids from its
        Python list once per change, not once per group and step: served, those are hundreds
        of lists of scattered int objects, cold after the rest of the step's host work
        (test_decode_rows_follow_the_kv_managers_tables_step_by_step)."""
        table = seq.block_table
        key = (kv is None, -1 if self._has_full_group or kv is None else used)
        held = self._group_arrays.get(id(seq))
        if held is not None and held[0] is seq and held[1] is table and held[2] == key:
            return held[3]
        if len(self._group_arrays) >= self._prune_at:
            self._prune_group_arrays()
        flat = np.asarray(table, dtype=np.int64)
        if kv is None:
            rows = flat
        else:
            counts = kv.group_blocks_of(seq)
            full = self.group_is_full
            length = max([n for n, f in zip(counts, full) if f] or [used])
            rows = np.zeros((self.num_tables, length), dtype=np.int64)
            offset = 0
            for g, n in enumerate(counts):
                lead = max(0, length - n)
                rows[g, lead:] = flat[offset:offset + length - lead]
                offset += n
        self._group_arrays[id(seq)] = (seq, table, key, rows)
        return rows

    def _prune_group_arrays(self) -> None:
        """Drop the arrays of sequences whose table has changed since (a freed sequence's is
        an empty list); the bound then doubles if what is left is still over half of it (the
        profiler's grid keeps thousands of fixed sequences alive, a served run at most its
        running ones and those admitted since)."""
        self._group_arrays = {k: held for k, held in self._group_arrays.items()
                              if held[0].block_table is held[1]}
        self._prune_at = max(self._prune_at, 2 * len(self._group_arrays))

    def run_decode(self, single: list, kv=None) -> tuple:
        """A decode-only step: (sampled tokens in the order of `single`, host prep seconds).
        `kv`: the KV manager (KV cache groups; None: every group uses the whole table)."""
        t0 = time.perf_counter()
        n, n_t = len(single), self.num_tables
        b = next(b for b in self.decode_buckets() if b >= n)
        h = self.h_i64.numpy()
        lens = self.h_seq_lens.numpy()
        width = self._decode_width(single)
        size = n_t * n * width
        tables = self.h_tables.numpy()[:size].reshape(n_t, n, width)
        self._write_decode_rows(single, h, lens, tables, kv)
        h[0, n:b] = 0
        h[1, n:b] = 0
        h[2:, n:b] = -1                    # padding rows write nothing
        lens[n:b] = 1
        self.g_i64.copy_(self.h_i64, non_blocking=True)
        self.g_seq_lens.copy_(self.h_seq_lens, non_blocking=True)
        stage = self.g_tables_stage[:size]
        stage.copy_(self.h_tables[:size], non_blocking=True)
        self.g_tables[:, :n, :width].copy_(stage.view(n_t, n, width))
        prep_s = time.perf_counter() - t0
        logits, tokens = self._replay(self.decode_graphs, b, self.decode_step)
        if self.ex.poison:
            self.ex._check_logits(logits[:n])
        return tokens[:n].tolist(), prep_s

    def run_mixed(self, prefill: list, single: list, bucket: int, kv=None) -> tuple:
        """A step with prefill chunks in the fixed-shape layout: decode rows [0, D), the chunks'
        tokens [D, D + P), padding up to `bucket`. Returns (sampled tokens, decodes first, then
        the chunks; host prep seconds). `kv` as for `run_decode`."""
        t0 = time.perf_counter()
        n_dec, n_pf, n_t = len(single), len(prefill), self.num_tables
        d_cap, p_cap, r_cap = self.mixed_caps(bucket)
        top_d, top_p, _ = self.m_caps
        h = self.hm_i64.numpy()
        i32 = self.hm_i32.numpy()
        rows = self.hm_rows.numpy()
        w_dec = self._decode_width(single)
        flat = self.hm_tables.numpy()
        self._write_decode_rows(single, h, i32,
                                flat[:n_t * n_dec * w_dec].reshape(n_t, n_dec, w_dec), kv)
        rows[:n_dec] = np.arange(n_dec)          # a decode row samples its only token
        i32[n_dec:d_cap] = 0                     # padding decode rows: skipped by the kernel
        # the chunks, after the decode rows
        ids, pos, slots, pf_tables, seq_lens, q_lens = host_inputs(prefill, self.ex.block_size)
        if self.group_is_full:
            slots, pf_tables = group_host_inputs(prefill, kv, self.group_is_full,
                                                 self.ex.group_windows, self.ex.block_size)
        else:
            slots, pf_tables = [slots], [pf_tables]
        ends = n_dec + np.cumsum([0] + q_lens)
        used = int(ends[-1])
        h[0, n_dec:used] = np.concatenate(ids)
        h[1, n_dec:used] = np.concatenate(pos)
        for g, table_slots in enumerate(slots):
            h[2 + g, n_dec:used] = np.concatenate(table_slots)
        h[0, used:bucket] = 0
        h[1, used:bucket] = 0
        h[2:, used:bucket] = -1                  # padding rows write nothing
        rows[n_dec:n_dec + n_pf] = ends[1:] - 1  # each chunk's last token
        rows[n_dec + n_pf:r_cap] = 0
        qsl = i32[top_d:top_d + top_p + 1]
        qsl[:n_pf + 1] = ends
        qsl[n_pf + 1:p_cap + 1] = used           # padding sequences: no new tokens
        pf_lens = i32[top_d + top_p + 1:]
        pf_lens[:n_pf] = seq_lens
        pf_lens[n_pf:p_cap] = 0
        w_pf = max(len(t) for t in pf_tables[0])
        dec_size, pf_size = n_t * n_dec * w_dec, n_t * n_pf * w_pf
        pf_flat = flat[dec_size:dec_size + pf_size].reshape(n_t, n_pf, w_pf)
        for g in range(n_t):
            for j, t in enumerate(pf_tables[g]):
                pf_flat[g, j, :len(t)] = t
        self.m_i64.copy_(self.hm_i64, non_blocking=True)
        self.m_rows.copy_(self.hm_rows, non_blocking=True)
        self.m_i32.copy_(self.hm_i32, non_blocking=True)
        stage = self.m_tables_stage[:dec_size + pf_size]
        stage.copy_(self.hm_tables[:dec_size + pf_size], non_blocking=True)
        if n_dec:
            self.m_dec_tables[:, :n_dec, :w_dec].copy_(stage[:dec_size].view(n_t, n_dec, w_dec))
        self.m_pf_tables[:, :n_pf, :w_pf].copy_(stage[dec_size:].view(n_t, n_pf, w_pf))
        prep_s = time.perf_counter() - t0
        logits, tokens = self._replay(self.mixed_graphs, bucket, self.mixed_step)
        n = n_dec + n_pf
        if self.ex.poison:
            self.ex._check_logits(logits[:n])
        return tokens[:n].tolist(), prep_s
