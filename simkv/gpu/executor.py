"""GpuExecutor: carries out one StepPlan on the sample model and returns the sampled tokens.

    outputs = executor.execute(plan)      # {seq_id: token id}, greedy

Per step: swap-outs, copy-on-write block copies and swap-ins are applied first (in that order: a
block freed by a swap-out may be a copy's destination in the same step; `swap.order_swap_outs`
has the one exception), then one forward over the flattened batch, then greedy sampling (argmax
of the last token's logits) for every sequence whose chunk reaches the end of its known tokens.
Inputs (token ids, positions, slot mapping, block tables, varlen metadata) are built on the host
with numpy and sent in one copy per dtype (`simkv.gpu.step_inputs`).

Decode-only steps, and steps with prefill chunks of up to 2,048 tokens, run as CUDA graphs over
static input buffers (`simkv.gpu.graph_steps`; with KV cache groups a slot mapping and block
tables per group); larger steps run eagerly, bound by device work rather than by kernel
launches. `enforce_eager=True` turns graphs off; `static_inputs=True` runs
steps through the fixed-shape buffers without capturing (the CPU tests of the graphed path).

Debug mode `SIMKV_POISON_FREED=1` (or `poison=True`): after every step the engine overwrites the
K/V of every free block that the prefix cache cannot hit (swapped-out blocks included) with NaN,
the destinations of copies and swap-ins are overwritten with NaN just before they are written, and
any NaN reaching the hidden states or logits raises: a stale block table, a missed copy-on-write or
a lost swap cannot go unnoticed.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from simkv.gpu.attention import AttentionMetadata
from simkv.gpu.host import collection_held
from simkv.gpu.model import LlamaModel
from simkv.gpu.step_inputs import Staging, cdiv, group_host_inputs, host_inputs, pad_tables


def poison_enabled() -> bool:
    return os.environ.get("SIMKV_POISON_FREED", "") not in ("", "0", "false", "False")


class GpuExecutor:
    """The sample model and its paged KV cache on one device; `execute(plan)` runs a step."""

    def __init__(self, model_spec, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 device: str | None = None, dtype=None, attention: str | None = None,
                 enforce_eager: bool = False, seed: int = 0, *, max_num_seqs: int = 256,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
                 poison: bool | None = None, profile_memory: bool = True,
                 static_inputs: bool = False, model_factory=None, kv_groups=None):
        """`device` 'cuda' | 'cpu' (default: cuda when available); `dtype` default bfloat16 on
        CUDA, float64 on CPU; `attention` 'triton' | 'reference' (default: triton on CUDA,
        reference on CPU; triton on CPU needs TRITON_INTERPRET=1). `num_host_blocks` bounds the
        swap space (allocated as needed). `max_model_len` sizes the graphs' block tables.
        `model_factory(spec, device, dtype, seed, attention)` builds the model (default
        LlamaModel; a tensor-parallel rank's: simkv.gpu.tensor_parallel). `kv_groups` (the
        sizing's kv_groups, for a model with sliding-window layers beside full ones): the caches
        are laid out by group and each group gets its own slot mapping and block tables, from
        the KV manager passed to `execute` (without one every group uses the whole table); the
        fixed-shape steps hold a slot mapping and block tables per group, so such steps run as
        CUDA graphs like any other."""
        self.kv_groups = kv_groups
        self.group_is_full = [g["attention_type"] == "full" for g in kv_groups or ()]
        self.group_windows = [g.get("window") for g in kv_groups or ()]
        self.model_factory = model_factory or LlamaModel
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        is_cuda = self.device.type == "cuda"
        dtype = _torch_dtype(dtype, is_cuda)
        attention = _attention_backend(attention, dtype, is_cuda)
        self.spec = model_spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        self.attention = attention
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or model_spec.max_position_embeddings
        self.poison = poison_enabled() if poison is None else poison
        self.last_gpu_s = float("nan")     # CUDA-event span of the last execute (see execute)
        self.last_prep_s = 0.0             # host input preparation inside that span
        self.num_graph_steps = 0           # decode-only steps run as CUDA graphs
        self.num_mixed_graph_steps = 0     # steps with prefill chunks run as CUDA graphs
        self.num_eager_steps = 0
        self._allocate(seed, profile_memory)
        self._prepare_steps(enforce_eager, static_inputs)

    # -- setup --------------------------------------------------------------------------------
    def _allocate(self, seed: int, profile_memory: bool) -> None:
        """The model's weights, then (on CUDA) the activation workspace profile, then the KV
        pool; the memory ledger snapshots each stage."""
        from simkv.gpu.ledger import MemoryLedger
        is_cuda = self.device.type == "cuda"
        self.ledger = MemoryLedger(self.device) if is_cuda else None
        self.model = self.model_factory(self.spec, self.device, self.dtype, seed, self.attention)
        if self.kv_groups:
            self.model.use_kv_groups(self.kv_groups)
        self.weight_bytes = self.model.weight_bytes
        if self.ledger:
            self.ledger.snapshot("weights")
        self.profile = {}
        if is_cuda and profile_memory:
            self.profile = self.profile_activation(self.max_num_batched_tokens, self.max_num_seqs)
            self.ledger.snapshot("profile")
        if is_cuda:
            self._check_fits(self.num_blocks)
        self.caches = self.model.allocate_kv_cache(self.num_blocks, self.block_size)
        self.kv_pool_bytes = self.caches.numel() * self.caches.element_size()
        if self.ledger:
            self.ledger.snapshot("kv_pool")
        self.swap_space = None
        self._i64 = Staging(torch.int64, self.device)
        self._i32 = Staging(torch.int32, self.device)
        # a host buffer per group: an upload's pinned buffer must not be refilled while its
        # copy may still be in flight
        self._group_staging = [Staging(torch.int64, self.device) for _ in self.kv_groups or ()]

    def _prepare_steps(self, enforce_eager: bool, static_inputs: bool) -> None:
        """Compile the eager steps' kernel variants and build (and on CUDA capture) the
        fixed-shape steps."""
        is_cuda = self.device.type == "cuda"
        self.use_graphs = is_cuda and not enforce_eager and self.attention == "triton"
        self.static_inputs = self.use_graphs or static_inputs
        if is_cuda and self.attention == "triton":
            self.warmup()
            torch.cuda.empty_cache()
            self.ledger.snapshot("warmup")
        self.steps = None                  # fixed-shape steps (simkv.gpu.graph_steps)
        if self.static_inputs:
            from simkv.gpu.graph_steps import GraphSteps
            self.steps = GraphSteps(self)
        if self.use_graphs:
            self.steps.capture()
            self.ledger.snapshot("graphs")
        if self.ledger:
            self.ledger.reset_peak()

    def _check_fits(self, num_blocks: int) -> None:
        bytes_per_block = (2 * self.model.num_cache_slots * self.block_size * self.model.num_kv_heads
                           * self.spec.head_dim * torch.finfo(self.dtype).bits // 8)
        need = num_blocks * bytes_per_block
        free, _ = torch.cuda.mem_get_info(self.device)
        workspace = self.profile.get("peak_bytes", 0)
        headroom = 1 << 30   # graphs, staging, allocator slack
        if need + workspace + headroom > free:
            raise MemoryError(
                f"the KV pool of {num_blocks} blocks needs {need / 2**30:.1f} GiB, the workspace "
                f"{workspace / 2**30:.1f} GiB and ~1 GiB for graphs; {free / 2**30:.1f} GiB is "
                "free on the device: lower cache.gpu_memory_utilization or set "
                "cache.num_gpu_blocks_override")

    def profile_activation(self, num_tokens: int, num_seqs: int) -> dict:
        """Peak workspace of forwards over `num_tokens` and `num_tokens // 2` tokens (one prefill
        chunk each, `num_seqs` sampled rows) above the tensors alive before them, in bytes; the
        temporary cache the forward writes into is excluded. Returns base + per-token fit."""
        peaks = {}
        for tokens in (num_tokens, max(1, num_tokens // 2)):
            blocks = cdiv(tokens, self.block_size)
            cache = self.model.allocate_kv_cache(blocks, self.block_size)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            dev = self.device
            ids = torch.randint(0, self.spec.vocab_size, (tokens,), device=dev)
            pos = torch.arange(tokens, device=dev)
            meta = AttentionMetadata(
                slot_mapping=pos.clone(), num_prefill_tokens=tokens,
                prefill_block_tables=torch.arange(blocks, device=dev, dtype=torch.int32)[None],
                prefill_query_start_loc=torch.tensor([0, tokens], device=dev, dtype=torch.int32),
                prefill_seq_lens=torch.tensor([tokens], device=dev, dtype=torch.int32))
            rows = torch.arange(max(0, tokens - num_seqs), tokens, device=dev)
            with torch.inference_mode():
                self.model.forward(ids, pos, meta, cache, rows).float().argmax(-1)
            torch.cuda.synchronize(self.device)
            peaks[tokens] = torch.cuda.max_memory_allocated(self.device) - base
            del cache, ids, pos, meta, rows
            torch.cuda.empty_cache()
        (t1, p1), (t2, p2) = sorted(peaks.items())
        per_token = (p2 - p1) / (t2 - t1) if t2 != t1 else 0.0
        return {"peak_bytes": int(max(p1, p2)), "tokens": int(t2),
                "activation_bytes_per_batched_token": float(per_token),
                "activation_base_bytes": float(max(0.0, p2 - per_token * t2))}

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile every Triton variant an eager (prefill or mixed) step can meet: prefill over
        1, 2 and 16 sequences (integer 1 and multiples of 16 are specialised), decodes with one
        and several splits. Writes into cache blocks, so call it before any request runs."""
        from types import SimpleNamespace

        from simkv.engine.plan import ScheduledSeq
        bs, n = self.block_size, self.num_blocks
        vocab = self.spec.vocab_size
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        many = cdiv(4 * sms, self.spec.num_kv_heads)     # enough rows for a single split

        def item(start: int, count: int) -> ScheduledSeq:
            total = start + count
            seq = SimpleNamespace(token_ids=[i % vocab for i in range(total)], num_tokens=total,
                                  block_table=[b % n for b in range(cdiv(total, bs))], seq_id=0)
            return ScheduledSeq(seq, start, count, count == 1)

        for num_prefill, num_decode in ((1, 2), (2, many), (16, 1)):
            self._run_eager([item(0, 8) for _ in range(num_prefill)],
                            [item(511, 1) for _ in range(num_decode)])
        torch.cuda.synchronize(self.device)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan, kv=None) -> dict:
        """Run `plan`: memory operations, then the forward; returns {seq_id: greedy token}.

        `kv` (the scheduler's KV manager, optional) orders a swap-out after a copy-on-write in
        the one case the plan's lists cannot express (see `swap.order_swap_outs`).

        Afterwards `last_gpu_s` is the CUDA-event span from the first memory operation to the
        sampled tokens on the host: the host input preparation, the forward, sampling and the
        copy back (wall time on CPU); `last_prep_s` is the host input preparation inside it,
        during which the device has at most the memory operations to do.

        Python's automatic garbage collection is held off during the step: one started by an
        eager forward's short-lived tensors stalls a host-bound step's launches (simkv.gpu.host);
        collections that fall due run after the step returns."""
        with collection_held():
            return self._execute(plan, kv)

    def _execute(self, plan, kv=None) -> dict:
        cuda = self.device.type == "cuda"
        if cuda:
            start_evt = torch.cuda.Event(enable_timing=True)
            end_evt = torch.cuda.Event(enable_timing=True)
            start_evt.record()
        else:
            t0 = time.perf_counter()
        self._apply_memory_ops(plan, kv)
        outputs = {}
        self.last_prep_s = 0.0
        if plan.scheduled:
            prefill = [it for it in plan.scheduled if it.num_tokens > 1]
            single = [it for it in plan.scheduled if it.num_tokens == 1]
            steps = self.steps
            bucket = None
            if steps is not None and prefill:
                num_tokens = len(single) + sum(it.num_tokens for it in prefill)
                bucket = steps.mixed_bucket(len(prefill), len(single), num_tokens)
            if not prefill and steps is not None and len(single) <= steps.decode_buckets()[-1]:
                tokens, self.last_prep_s = steps.run_decode(single, kv)
                ordered, rows = single, range(len(single))
                self.num_graph_steps += 1
            elif bucket is not None:
                tokens, self.last_prep_s = steps.run_mixed(prefill, single, bucket, kv)
                ordered = single + prefill
                rows = range(len(ordered))
                self.num_mixed_graph_steps += 1
            else:
                ordered = prefill + single
                tokens, rows = self._run_eager(prefill, single, kv)
                self.num_eager_steps += 1
            for row, token in zip(rows, tokens):
                item = ordered[row]
                if item.start + item.num_tokens == item.seq.num_tokens:
                    outputs[item.seq.seq_id] = token
        if cuda:
            end_evt.record()
            end_evt.synchronize()
            self.last_gpu_s = start_evt.elapsed_time(end_evt) / 1e3
        else:
            self.last_gpu_s = time.perf_counter() - t0
        return outputs

    def _apply_memory_ops(self, plan, kv=None) -> None:
        from simkv.gpu import swap
        # With poisoning, a copy's or swap-in's destination (possibly an evicted cache block with
        # finite, stale K/V) is poisoned just before it is written, so that a copy or swap-in
        # that does not happen cannot go unnoticed. Not earlier: a swap-out may read it first.
        early, late = swap.order_swap_outs(plan, kv)
        if early:
            self._ensure_host_capacity(1 + max(h for _, h in early))
            swap.swap_out(self.caches, self.swap_space, early)
        if plan.block_copies:
            if self.poison:
                self._poison([d for _, d in plan.block_copies])
            mapping = torch.tensor(plan.block_copies, dtype=torch.int64).to(self.device)
            attn = self.model.attn
            for layer in range(self.caches.shape[0]):
                attn.copy_blocks(self.caches[layer, 0], self.caches[layer, 1], mapping)
        if late:
            self._ensure_host_capacity(1 + max(h for _, h in late))
            swap.swap_out(self.caches, self.swap_space, late)
        if plan.swap_in:
            if self.poison:
                self._poison([d for _, d in plan.swap_in])
            swap.swap_in(self.caches, self.swap_space, [(d, h) for h, d in plan.swap_in])

    def reserve_swap_space(self) -> None:
        """Allocate the whole host swap space (`num_host_blocks`) now, as a server does at
        start-up for swap preemption. Grown on demand instead, the step that first needs more
        stalls on the pinned allocation and the copy of what is already swapped out (1.5 s in
        one step of the H200 tight-swap validation run, at 16 GiB)."""
        if self.num_host_blocks:
            self._ensure_host_capacity(self.num_host_blocks)

    def _ensure_host_capacity(self, blocks: int) -> None:
        """Grow the host swap space to hold host block ids < `blocks` (the host pool hands out
        the lowest ids first, so the space stays as small as the peak of swapped blocks)."""
        from simkv.gpu.swap import HostSwapSpace
        have = 0 if self.swap_space is None else self.swap_space.num_blocks
        if blocks <= have:
            return
        if self.num_host_blocks and blocks > self.num_host_blocks:
            raise RuntimeError(f"host block {blocks - 1} is beyond the swap space of "
                               f"{self.num_host_blocks} blocks")
        size = max(blocks, 2 * have, 16)
        if self.num_host_blocks:
            size = min(size, self.num_host_blocks)
        space = HostSwapSpace.allocate(size, self.caches)
        if have:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # earlier swap copies are asynchronous
            space.blocks[:have].copy_(self.swap_space.blocks)
        self.swap_space = space

    def _group_metadata(self, items: list, num_p: int, kv) -> list:
        """Per KV cache group, the step's slot mapping and block tables (AttentionMetadata;
        each group's table as `step_inputs.group_tables` lays it out). Without `kv` (warm-up,
        the profiler) every group uses the whole table."""
        slots, tables = group_host_inputs(items, kv, self.group_is_full, self.group_windows,
                                          self.block_size)
        metas = []
        for g in range(len(self.kv_groups)):
            arrays = [np.concatenate(slots[g])]
            if num_p:
                arrays.append(pad_tables(tables[g][:num_p]).ravel())
            if len(items) > num_p:
                arrays.append(pad_tables(tables[g][num_p:]).ravel())
            d = self._group_staging[g].upload(arrays)
            meta = AttentionMetadata(slot_mapping=d[0])
            if num_p:
                meta.prefill_block_tables = d[1].view(num_p, -1).to(torch.int32)
            if len(items) > num_p:
                meta.decode_block_tables = d[-1].view(len(items) - num_p, -1).to(torch.int32)
            metas.append(meta)
        return metas

    def _run_eager(self, prefill: list, single: list, kv=None):
        t0 = time.perf_counter()
        ids, pos, slots, tables, seq_lens, q_lens = host_inputs(prefill + single, self.block_size)
        num_p = len(prefill)
        num_prefill_tokens = int(sum(q_lens[:num_p]))
        ends = np.cumsum([0] + q_lens)
        rows = ends[1:] - 1                          # last token of every item
        i64 = [np.concatenate(ids), np.concatenate(pos), np.concatenate(slots), rows]
        i32 = []
        if num_p:
            pt = pad_tables(tables[:num_p])
            i32 += [pt.ravel(), ends[:num_p + 1], np.asarray(seq_lens[:num_p])]
        if single:
            dt = pad_tables(tables[num_p:])
            i32 += [dt.ravel(), np.asarray(seq_lens[num_p:])]
        d_ids, d_pos, d_slots, d_rows = self._i64.upload(i64)
        d32 = self._i32.upload(i32)
        meta = AttentionMetadata(slot_mapping=d_slots, num_prefill_tokens=num_prefill_tokens)
        if num_p:
            meta.prefill_block_tables = d32[0].view(num_p, -1)
            meta.prefill_query_start_loc = d32[1]
            meta.prefill_seq_lens = d32[2]
            d32 = d32[3:]
        if single:
            meta.decode_block_tables = d32[0].view(len(single), -1)
            meta.decode_seq_lens = d32[1]
        if self.kv_groups:
            meta.groups = self._group_metadata(prefill + single, num_p, kv)
        self.last_prep_s = time.perf_counter() - t0
        logits = self.model.forward(d_ids, d_pos, meta, self.caches, d_rows,
                                    check_finite=self.poison)
        self._check_logits(logits)
        return logits.argmax(-1).tolist(), range(len(rows))

    def _check_logits(self, logits: torch.Tensor) -> None:
        if self.poison and not bool(torch.isfinite(logits).all()):
            raise FloatingPointError("NaN logits: a forward read a freed, swapped-out or "
                                     "never-written KV slot (SIMKV_POISON_FREED)")

    # -- debug --------------------------------------------------------------------------------
    @torch.inference_mode()
    def poison_free_blocks(self, kv) -> int:
        """Overwrite with NaN the K/V of every free block the prefix cache cannot hit (no hash);
        returns how many. Call after `finish_step`. No-op for managers without a block pool."""
        pool = getattr(kv, "pool", None)
        if pool is None:
            return 0
        block_hash = pool.block_hash
        blocks = [b for b in pool.free_queue if block_hash[b] is None]
        self._poison(blocks)
        return len(blocks)

    def _poison(self, blocks: list) -> None:
        if blocks:
            index = torch.tensor(blocks, dtype=torch.int64).to(self.device)
            self.caches.index_fill_(2, index, float("nan"))


def _torch_dtype(dtype, is_cuda: bool):
    """The cache and weight dtype: a torch dtype or its name; default bfloat16 on CUDA, float64
    on CPU."""
    if dtype is None:
        return torch.bfloat16 if is_cuda else torch.float64
    if isinstance(dtype, str):
        return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
                "fp64": torch.float64, "float64": torch.float64}[dtype]
    return dtype


def _attention_backend(attention, dtype, is_cuda: bool) -> str:
    """'triton' or 'reference' (default: triton on CUDA, reference on CPU), checked against the
    dtype and device."""
    if attention is None:
        attention = "triton" if is_cuda else "reference"
    if attention == "triton":
        if dtype == torch.float64:
            raise ValueError("the Triton kernels take float32/16-bit caches; float64 needs "
                             "attention='reference'")
        if not is_cuda and not _interpreting():
            raise ValueError("attention='triton' on CPU needs TRITON_INTERPRET=1 set before "
                             "triton is imported")
    return attention


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
