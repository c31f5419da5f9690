"""The settable sections of a scenario (`cache:`, `scheduler:`, `workload:`): typed dataclasses
with the defaults of INTERFACE.md."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    memory_budget_gib: Optional[float] = None   # when set, wins over gpu_memory_utilization
    kv_dtype: str = "bf16"                      # bf16 | fp8
    allocator: str = "paged"                    # paged | contiguous
    enable_prefix_caching: bool = True
    prefix_sharing_scope: str = "tenant"        # tenant | global
    watermark: float = 0.0                      # fraction of blocks kept free at admission
    preemption_mode: str = "recompute"          # recompute | swap
    swap_space_gib: float = 4.0
    num_gpu_blocks_override: Optional[int] = None
    # rules that follow `semantics:` when left null (simkv.semantics)
    null_block: Optional[bool] = None           # one pool block kept as vLLM's null block
    duplicate_blocks: Optional[bool] = None     # several blocks may be indexed under one hash
    pool_sizing: Optional[str] = None           # vllm (graphs, allocator slack outside the
                                                # budget) | engine (simkv's engine's ledger)


@dataclass
class SchedulerConfig:
    max_num_seqs: Optional[int] = None          # None = the semantics' default for the GPU
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0       # 0 = no per-request cap beyond the budget
    max_model_len: Optional[int] = None         # None = the model's max_position_embeddings
    preemption_policy: str = "recent"           # recent (most recently admitted) | priority
    policy: str = "fcfs"                        # fcfs | priority (admission order and victims)
    max_loras: Optional[int] = None             # distinct adapters per step (None = no limit)
    async_scheduling: bool = False              # schedule step k+1 as step k starts (vLLM v0.26)
    # the request's way outside the steps (docs/semantics.md, "The request path"); 0 = none
    admission_delay_s: float = 0.0              # trace arrival -> schedulable by the engine
    output_delay_s: float = 0.0                 # a step's end -> the client holds its tokens
    output_delay_per_running_s: float = 0.0     # ... plus this per request running in the step
    # rules that follow `semantics:` when left null (simkv.semantics)
    reserve_full_prompt: Optional[bool] = None  # admit only when the whole prompt's blocks fit
    parallel_sampling: Optional[str] = None     # fanout (n child requests) | fork
    cap_output_tokens: Optional[bool] = None    # cap outputs at max_model_len; else reject


@dataclass
class WorkloadConfig:
    trace: Optional[Path] = None                # resolved relative to the scenario file
    format: str = "auto"
    time_scale: float = 1.0
    limit: Optional[int] = None
    synthetic: Optional[dict[str, Any]] = None  # generator spec (see simkv.workload.synthetic)
    # the window and its shape (simkv.workload.frames.shape_frame)
    offset: int = 0                             # skip the first N requests; the window starts at 0 s
    model_filter: Optional[list] = None         # BurstGPT: keep the rows of these Model names
    prompt_scale: float = 1.0                   # multiply prompt lengths (rounded, >= 1)
    output_scale: float = 1.0                   # multiply output lengths (rounded, >= 1)
    resample: Optional[str] = None              # bootstrap: a block bootstrap drawn with `seed`

