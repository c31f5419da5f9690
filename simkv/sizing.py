"""KV sizing arithmetic: how many KV blocks fit next to the weights and the runtime's workspace.

    kv_pool_bytes = memory_budget_bytes - weights_bytes - activation_bytes - other_bytes
    num_blocks    = kv_pool_bytes // bytes_per_block        (or cache.num_gpu_blocks_override)

The subtracted terms come from a measured memory ledger (`profiles/<gpu>/<model>/ledger.json`)
when one exists (`source: "profile"`), else from the estimate below (`source: "estimate"`).
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from simkv import parallel
from simkv import semantics as rules
from simkv.kv_geometry import effective_block_size, kv_geometry
from simkv.specs import GpuSpec, ModelSpec, profiles_dir
from simkv.errors import InputError, read_json_object

# `cache` and `scheduler` arguments are a scenario's `cache:` and `scheduler:` settings
# (simkv.config.scenario.CacheConfig, SchedulerConfig), read by attribute: config sits above
# this module (it sizes a scenario to validate it), so their classes are not imported here.
CacheConfig = SchedulerConfig = Any

MIB = 1 << 20
GIB = 1 << 30

# Unquantized weights are served in bf16 (2 bytes per parameter); a checkpoint with a
# `quantization_config`, or a `weights_dtype` override, holds what simkv.weights charges.
WEIGHT_DTYPE_BYTES = 2

# --- Estimates used until a GPU profile exists ------------------------------------------------
# Corrected against the measured H200 ledgers of llama-3.1-8b and llama-3.2-1b
# (profiles/h200/*/ledger.json, `estimate_comparison`); docs/profiling.md has the figures.
#
# Activation workspace. vLLM sizes the KV pool after a profiling forward pass over
# max_num_batched_tokens tokens, so the peak activation scales with that token budget. Inside one
# layer the peak is the MLP: gate/up output (2 x intermediate) and the SiLU-and-mul output
# (1 x intermediate) live together with four hidden-size tensors (residual, normed copy, the
# attention output and the residual sum), all bf16. The measured peaks are linear in the token
# count through the origin: 118.8 KB/token for the 8B, 65.5 KB/token for the 1B, which this
# formula reproduces to 1% (the first estimate counted two hidden-size tensors and was 15-19% low
# per token). Attention's q/k/v + output is taken instead when larger.
ACTIVATION_DTYPE_BYTES = 2
HIDDEN_SIZED_TENSORS = 4
# The sampler's fp32 logits for each sampled row (at most max_num_seqs rows) exist after the
# last layer, when the MLP workspace is gone: the peak is the larger of the two, not their sum
# (the measured peaks show no logits term; the first estimate added two copies and was 13-23%
# high in total).
LOGITS_DTYPE_BYTES = 4
# Everything else the runtime holds outside the PyTorch tensors above, 3.19 GiB in all at the
# default scheduler settings (estimate; measured 3.81 GiB on the 8B, 3.15 GiB on the 1B):
# - memory outside PyTorch: CUDA context, cuBLAS handles and workspaces, Triton modules
#   (measured 761-767 MiB on the H200, not the 512 MiB first assumed);
# - the CUDA-graph memory pool (`estimate_graph_pool_bytes`);
# - caching-allocator slack at the peak: fragmentation between freed segments (measured 254 MiB
#   for the 1B; the 8B's 1.2 GiB of unattributed memory includes its graph pool, which the
#   allocator did not report separately).
CUDA_CONTEXT_BYTES = 768 * MIB
ALLOCATOR_SLACK_BYTES = 256 * MIB
# The CUDA-graph pool: every captured graph keeps its output logits (the sampled rows x vocab,
# model dtype) and segments of its own. Measured 2.30 GiB (llama-3.1-8b) and 2.09 GiB
# (llama-3.2-1b) with 9 decode and 19 mixed-step graphs (profiles/h200/*/ledger.json,
# serving_ledger, fifth profiles of 2026-11-29); the logits are 1.10 GiB of each, the rest 43 and
# 36 MiB per graph. (The first estimate, 464 MiB, measured decode graphs only.)
GRAPH_SEGMENT_BYTES = 40 * MIB
# The token budget of the profiler's engine pass, whose graph pool a ledger records (ledgers
# before 2026-11-29's fifth profile do not say it in `measured_with`).
PROFILE_ENGINE_BATCHED_TOKENS = 8192
# Swap mode: a swap moves its blocks through device staging tensors of at most this many bytes
# per chunk (simkv.gpu.swap); gathering a chunk holds two at once (the selected blocks and their
# block-major copy), and each chunk is released before the next one and before the forward,
# whose workspace then reuses it: sizing reserves what two chunks need beyond the workspace
# (nothing for an 8B at 8,192 batched tokens; the reuse is partial: the 8B's measured swap peak
# was ~94 MiB above the recompute run's, so the pool comes out ~0.9% large on 6 GiB, which the
# gpu_memory_utilization headroom absorbs). With 256 MiB chunks held three at a time and
# the host swap space grown during the run, the H200 tight-budget runs measured the swap
# engine's peak 512 MiB above the recompute engine's; with chunks released, 0.29 GiB above in
# one lease, and in another the engine's measured peak left 5.3% more blocks than a pool sized
# with two 128 MiB chunks reserved (profiles/h200/llama-3.1-8b/validation, azure-conv-tight-
# {swap,recompute}-bs16, realtime/ledger.json, 2026-11-29). Chunks of 128 MiB still move at the
# link's bandwidth (a 128 MiB copy is ~3.0 ms at 45 GB/s against ~0.3 ms per transfer).
# Mixture-of-experts layers (vLLM's fused_moe, vllm/model_executor/layers/fused_moe): per routed
# token and chosen expert, the gate/up output (2 x expert width) shares one buffer with the down
# output (hidden size), beside the activation output (1 x expert width), all in the model dtype
# (`intermediate_cache13`, `intermediate_cache2`); tokens are taken in chunks of at most
# VLLM_FUSED_MOE_CHUNK_SIZE (16,384 by default, vllm/envs.py). The router adds its logits (one
# per expert, model dtype) and the top-k weights (fp32) and ids (int32) per token.
# An estimate from the buffers' shapes, not measured: no MoE profile exists yet.
FUSED_MOE_CHUNK_TOKENS = 16384
TOPK_WEIGHT_ID_BYTES = 4 + 4
SWAP_STAGING_CHUNK_BYTES = 128 * MIB
SWAP_STAGING_CHUNKS = 2

# Per-GPU figures that `simkv size --json` also gives summed over the replica's GPUs
# (x tensor_parallel_size, `<key>_total`). A block of the replica spans all its ranks (each holds
# its KV heads' part), so the replica's scheduler has num_blocks blocks and caches
# max_cached_tokens tokens; num_blocks_total counts the per-GPU blocks.
TOTAL_KEYS = ("bytes_per_token", "bytes_per_block", "memory_budget_bytes", "weights_bytes",
              "kv_pool_bytes", "num_blocks", "num_gpu_blocks")

PROFILE_LEDGER_KEYS = (
    "weights_bytes",
    "activation_bytes_per_batched_token",
    "activation_base_bytes",
    "other_bytes",
)


@dataclass
class Sizing:
    """The result of `size_pool`; the keys of `simkv size --json` plus `num_host_blocks`."""

    model: str
    gpu: str
    block_size: int
    kv_dtype: str
    bytes_per_token: int
    bytes_per_block: int
    memory_budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    other_bytes: int
    kv_pool_bytes: int             # may be negative when the model does not fit; see fit_error
    num_blocks: int                # usable GPU blocks (never negative)
    max_cached_tokens: int         # num_blocks x block_size
    source: str                    # "profile" | "estimate"
    ledger: dict[str, Any] = field(default_factory=dict)
    num_host_blocks: int = 0       # blocks of host swap space (cache.swap_space_gib)
    ledger_file: Optional[str] = None  # the measured ledger used (source "profile")
    num_gpu_blocks: Optional[int] = None  # with cache.null_block: the pool as vLLM counts it,
                                          # num_blocks + its null block
    total_params: int = 0          # every parameter of the checkpoint
    active_params: int = 0         # those one token uses (total_params for a dense model)
    weights_dtype: str = "bf16"    # what the linear weights are stored as
    quantization: Optional[str] = None   # how (simkv.weights.Quantization.describe), or None
    moe: Optional[dict] = None     # a MoE model's experts (moe_summary), else None
    # Tensor parallelism: every figure above is one GPU's (rank's); the replica's GPUs together
    # hold tensor_parallel_size times the bytes and blocks (replicated parts counted on each).
    tensor_parallel_size: int = 1
    # KV cache groups (simkv.kv_geometry): per group its layers, attention type, window, bytes
    # per token summed over its layers; one group for a model whose layers all keep full KV
    kv_groups: list = field(default_factory=list)
    page_bytes: int = 0            # one layer's block, the same in every group
    layers_per_group: int = 0      # the pool's block is page_bytes x layers_per_group
    max_model_len: int = 0
    blocks_per_request: int = 0    # blocks a max_model_len request needs at most, all groups
    max_concurrency: float = 0.0   # such requests the pool holds at once (vLLM's figure)

    @property
    def needed_bytes(self) -> int:
        """Bytes the model needs before any KV cache: weights + activation + other."""
        return self.weights_bytes + self.activation_bytes + self.other_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable), keys as `simkv size --json` (num_gpu_blocks only
        with a null block; tensor_parallel_size and the `*_total` figures only above TP 1)."""
        out = asdict(self)
        for key in ("num_gpu_blocks", "moe"):
            if out[key] is None:
                del out[key]
        tp = self.tensor_parallel_size
        if tp == 1:
            del out["tensor_parallel_size"]
        else:
            for key in TOTAL_KEYS:
                if out.get(key) is not None:
                    out[f"{key}_total"] = out[key] * tp
        return out


def moe_summary(model: ModelSpec, scheduler: SchedulerConfig,
                tensor_parallel_size: int = 1) -> Optional[dict]:
    """A MoE model's experts for `simkv size`: counts, bytes of one routed expert of one layer
    and of all of them (whole checkpoint), and the expert layer's workspace at
    max_num_batched_tokens (one rank's)."""
    e = model.experts
    if e is None:
        return None
    return {
        "num_experts": e.num_experts, "top_k": e.top_k,
        "num_shared_experts": e.num_shared_experts,
        "expert_intermediate_size": e.expert_intermediate_size,
        "num_moe_layers": e.num_moe_layers, "expert_params": model.expert_params,
        "expert_bytes": model.expert_bytes, "routed_expert_bytes": model.routed_expert_bytes(),
        "moe_workspace_bytes": estimate_moe_workspace_bytes(
            model, scheduler.max_num_batched_tokens, tensor_parallel_size),
    }


def seq_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of `num_tokens` tokens occupies (the last one possibly partial)."""
    return -(-num_tokens // block_size)


def wasted_slots(num_tokens: int, block_size: int) -> int:
    """Token slots allocated to a `num_tokens` sequence but not holding a token."""
    return seq_blocks(num_tokens, block_size) * block_size - num_tokens


def memory_budget_bytes(gpu: GpuSpec, cache: CacheConfig) -> int:
    """The bytes simkv may use: memory_budget_gib if set, else utilisation x device memory."""
    if cache.memory_budget_gib is not None:
        return int(cache.memory_budget_gib * GIB)
    return math.floor(cache.gpu_memory_utilization * gpu.memory_bytes)


def estimate_moe_workspace_bytes(model: ModelSpec, tokens: int,
                                 tensor_parallel_size: int = 1) -> int:
    """Estimated workspace (bytes) of one mixture-of-experts layer over `tokens` routed tokens
    on one rank (FUSED_MOE_CHUNK_TOKENS above says what it holds; the experts' width is split
    over the ranks); 0 for a dense model."""
    e = model.experts
    if e is None:
        return 0
    width, hidden = e.expert_intermediate_size // tensor_parallel_size, model.hidden_size
    chunk = min(tokens, FUSED_MOE_CHUNK_TOKENS)
    experts = chunk * e.top_k * (max(2 * width, hidden) + width) * ACTIVATION_DTYPE_BYTES
    router = tokens * (e.num_experts * ACTIVATION_DTYPE_BYTES + e.top_k * TOPK_WEIGHT_ID_BYTES)
    shared = tokens * 3 * width * e.num_shared_experts * ACTIVATION_DTYPE_BYTES
    return experts + router + shared


def estimate_activation_bytes(model: ModelSpec, scheduler: SchedulerConfig,
                              tensor_parallel_size: int = 1) -> int:
    """Estimated peak activation workspace (bytes) of a forward over max_num_batched_tokens on
    one rank: the hidden-sized tensors (whole on every rank) plus the largest of a dense MLP's,
    attention's and (MoE) the expert layer's workspace (the rank's share of the intermediate
    features and heads), or the sampler's logits when larger (gathered whole on every rank)."""
    tp = tensor_parallel_size
    tokens = scheduler.max_num_batched_tokens
    dense_layers = model.num_layers - (model.experts.num_moe_layers if model.experts else 0)
    mlp_elems = 3 * model.intermediate_size // tp if dense_layers else 0
    attention_elems = (2 * model.num_heads // tp
                       + 2 * parallel.kv_heads_per_rank(model, tp)) * model.head_dim
    hidden = tokens * HIDDEN_SIZED_TENSORS * model.hidden_size * ACTIVATION_DTYPE_BYTES
    layer = max(tokens * max(mlp_elems, attention_elems) * ACTIVATION_DTYPE_BYTES,
                estimate_moe_workspace_bytes(model, tokens, tp))
    sampled_rows = min(scheduler.max_num_seqs, tokens)
    logits = sampled_rows * model.vocab_size * LOGITS_DTYPE_BYTES
    return max(hidden + layer, logits)


def estimate_graph_pool_bytes(model: ModelSpec, scheduler: SchedulerConfig) -> int:
    """Estimated CUDA-graph pool (bytes) of an engine with these settings: the logits every
    captured graph keeps (its sampled rows x vocab in the weights' dtype) plus
    GRAPH_SEGMENT_BYTES per graph. The graph sizes are the engine's (simkv.launch_policy)."""
    from simkv.launch_policy import decode_graph_sizes, mixed_graph_sizes
    decode = decode_graph_sizes(scheduler.max_num_seqs)
    mixed = mixed_graph_sizes(scheduler.max_num_batched_tokens)
    rows = sum(decode) + sum(min(t, scheduler.max_num_seqs) for t in mixed)
    return (rows * model.vocab_size * WEIGHT_DTYPE_BYTES
            + (len(decode) + len(mixed)) * GRAPH_SEGMENT_BYTES)


def read_profile_ledger(model: ModelSpec, gpu: GpuSpec,
                        tensor_parallel_size: int = 1) -> Optional[dict[str, Any]]:
    """The measured ledger `profiles/<gpu>/<model>/ledger.json` (above TP 1, one rank's in
    `<model>-tp<N>/`) as a dict, or None if absent."""
    path = profiles_dir() / gpu.name / parallel.profile_name(model.name, tensor_parallel_size) \
        / "ledger.json"
    if not path.is_file():
        return None
    ledger = read_json_object(path, "written by `simkv profile`")
    for key in PROFILE_LEDGER_KEYS:
        value = ledger.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InputError(f"{path}: '{key}' must be a non-negative number, got {value!r}")
    ledger["path"] = str(path)
    return ledger


def _profile_terms(profile: dict, model: ModelSpec, scheduler: SchedulerConfig) -> tuple:
    """(weights, activation, other, other_parts) bytes from a measured ledger, its graph pool
    moved to the scheduler's graph sizes."""
    weights = int(profile["weights_bytes"])
    activation = int(
        profile["activation_base_bytes"]
        + profile["activation_bytes_per_batched_token"] * scheduler.max_num_batched_tokens
    )
    other = int(profile["other_bytes"])
    # The measured breakdown of `other` when the profile gives one that adds up, else one part.
    parts = profile.get("other_parts")
    if isinstance(parts, dict) and parts and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in parts.values()) \
            and sum(parts.values()) == other:
        other_parts = {k: int(v) for k, v in parts.items()}
        # The graph pool was measured with the profile's engine settings; an engine with
        # other max_num_seqs / max_num_batched_tokens captures other graphs.
        pool = other_parts.get("cuda_graph_pool_bytes")
        if pool is not None:
            measured_with = profile.get("measured_with") or {}
            profiled = SimpleNamespace(    # the profile's engine settings
                max_num_seqs=int(measured_with.get("max_num_seqs", 256)),
                max_num_batched_tokens=int(measured_with.get(
                    "max_num_batched_tokens", PROFILE_ENGINE_BATCHED_TOKENS)))
            shift = (estimate_graph_pool_bytes(model, scheduler)
                     - estimate_graph_pool_bytes(model, profiled))
            other_parts["cuda_graph_pool_bytes"] = max(0, pool + shift)
            other += other_parts["cuda_graph_pool_bytes"] - pool
    else:
        other_parts = {"other_bytes": other}
    return weights, activation, other, other_parts


def _estimated_terms(model: ModelSpec, scheduler: SchedulerConfig,
                     tensor_parallel_size: int = 1) -> tuple:
    """(weights, activation, other, other_parts) bytes of one rank from the estimates above
    (the CUDA context, graph pool and allocator slack are per GPU: whole on every rank)."""
    weights = parallel.rank_weight_bytes(model, tensor_parallel_size)
    activation = estimate_activation_bytes(model, scheduler, tensor_parallel_size)
    other_parts = {
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "cuda_graph_pool_bytes": estimate_graph_pool_bytes(model, scheduler),
        "allocator_slack_bytes": ALLOCATOR_SLACK_BYTES,
    }
    return weights, activation, sum(other_parts.values()), other_parts


# the parts of "other" that vLLM's pool sizing leaves outside the budget (cache.pool_sizing: vllm)
OUTSIDE_VLLM_BUDGET = ("cuda_graph_pool_bytes", "allocator_slack_bytes")


def size_pool(
    model: ModelSpec, gpu: GpuSpec, cache: CacheConfig, scheduler: SchedulerConfig,
    tensor_parallel_size: int = 1,
) -> Sizing:
    """Size the KV pool of `model` on `gpu` (all figures in bytes unless named otherwise); with
    `tensor_parallel_size` N > 1 (checked by simkv.parallel.check before), one GPU's of N:
    its share of the weights and KV heads (simkv.parallel), the workspace of its shards.

    Never raises for a model that does not fit: kv_pool_bytes goes negative and num_blocks to 0;
    use `fit_error` to turn that into a message. Rules left null (a config built in code, not
    loaded from a scenario) take semantics vllm-0.26's values.
    """
    if scheduler.max_num_seqs is None or scheduler.max_num_batched_tokens is None \
            or cache.null_block is None or cache.pool_sizing is None:
        cache, scheduler = copy.copy(cache), copy.copy(scheduler)
        rules.resolve(rules.DEFAULT_SEMANTICS, cache, scheduler, gpu)
    tp = tensor_parallel_size
    max_model_len = scheduler.max_model_len or model.max_position_embeddings
    block_size = effective_block_size(model, gpu.name, cache.block_size, max_model_len)
    # one rank's share: its KV heads (an MLA latent whole), its linear-attention heads
    per_layer = parallel.kv_bytes_per_token(model, cache.kv_dtype, tp) \
        // max(1, model.num_attention_layers)
    geometry = kv_geometry(model, per_layer, block_size, max_model_len,
                           model.linear_state_bytes() // tp)
    # a full-attention model: one group of every layer, its bytes per token x block_size
    bytes_per_block = geometry.bytes_per_block
    bytes_per_token = geometry.bytes_per_token
    budget = memory_budget_bytes(gpu, cache)

    profile = read_profile_ledger(model, gpu, tp)
    if profile is not None:
        source = "profile"
        weights, activation, other, other_parts = _profile_terms(profile, model, scheduler)
        ledger_file = profile["path"]
    else:
        source = "estimate"
        weights, activation, other, other_parts = _estimated_terms(model, scheduler, tp)
        ledger_file = None
    # vLLM sizes its pool by a profile run: the budget less the weights, the peak of torch's
    # allocations and the memory outside torch; CUDA graphs are captured afterwards and the
    # allocator's reserve is not counted, so both lie outside the budget
    # (vllm/v1/worker/gpu_worker.py, Worker.determine_available_memory)
    outside_budget = 0
    if cache.pool_sizing == "vllm":
        outside_budget = sum(other_parts.get(k, 0) for k in OUTSIDE_VLLM_BUDGET)
        other -= outside_budget
    if cache.preemption_mode == "swap":
        # The staging is freed before the forward runs, on the same stream, so the allocator
        # hands its memory to the forward's workspace: only what exceeds the workspace adds.
        other_parts["swap_staging_bytes"] = max(
            0, SWAP_STAGING_CHUNKS * SWAP_STAGING_CHUNK_BYTES - int(activation))
        other += other_parts["swap_staging_bytes"]

    kv_pool = budget - weights - activation - other
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        num_blocks = max(0, kv_pool // bytes_per_block)
    kv_blocks = num_blocks * bytes_per_block
    num_gpu_blocks = None
    if cache.null_block:
        # vLLM's block pool keeps block 0 as the null block, never handed out
        # (vllm/v1/core/block_pool.py, BlockPool.__init__): the usable blocks are one fewer.
        # The override counts usable blocks (vLLM's own flag would be one more).
        if cache.num_gpu_blocks_override is not None:
            num_gpu_blocks = num_blocks + 1
        else:
            num_gpu_blocks, num_blocks = num_blocks, max(0, num_blocks - 1)

    # Parts that add up to the device total: what the runtime holds, the KV blocks, the pool's
    # remainder that does not make a whole block, and the memory outside the budget.
    ledger = {
        "device_memory_bytes": gpu.memory_bytes,
        "outside_budget_bytes": gpu.memory_bytes - budget - outside_budget,
        "weights_bytes": weights,
        "activation_bytes": activation,
        **other_parts,
        "kv_blocks_bytes": kv_blocks,
        "kv_pool_remainder_bytes": kv_pool - kv_blocks,
    }
    pool_blocks = num_gpu_blocks if num_gpu_blocks is not None else num_blocks
    per_request = geometry.blocks_per_request(max_model_len, scheduler.max_num_batched_tokens)
    return Sizing(
        model=model.name, gpu=gpu.name, block_size=block_size, kv_dtype=cache.kv_dtype,
        bytes_per_token=bytes_per_token, bytes_per_block=bytes_per_block,
        memory_budget_bytes=budget, weights_bytes=weights, activation_bytes=activation,
        other_bytes=other, kv_pool_bytes=kv_pool, num_blocks=num_blocks,
        # vLLM's "GPU KV cache size" (_report_kv_cache_config): a token takes a block slot in
        # every group
        max_cached_tokens=num_blocks // len(geometry.groups) * block_size, source=source,
        ledger=ledger,
        num_host_blocks=int(cache.swap_space_gib * GIB) // bytes_per_block,
        ledger_file=ledger_file, num_gpu_blocks=num_gpu_blocks,
        total_params=model.num_params, active_params=model.active_params,
        weights_dtype=model.weights_dtype,
        quantization=model.quantization.describe() if model.quantization else None,
        moe=moe_summary(model, scheduler, tp),
        tensor_parallel_size=tp,
        kv_groups=[g.to_dict() for g in geometry.groups], page_bytes=geometry.page_bytes,
        layers_per_group=geometry.group_size, max_model_len=max_model_len,
        blocks_per_request=per_request,
        max_concurrency=pool_blocks / per_request if per_request else 0.0,
    )


def size_scenario(scenario) -> Sizing:
    """`size_pool` of a scenario (simkv.config.scenario.Scenario, read by attribute): its
    model, GPU, cache and scheduler settings and tensor_parallel_size."""
    return size_pool(scenario.model, scenario.gpu, scenario.cache, scenario.scheduler,
                     getattr(scenario, "tensor_parallel_size", 1))


def fit_error(sizing: Sizing, max_model_len: Optional[int] = None) -> Optional[str]:
    """Why this sizing cannot serve (a one-line message), or None when it can.

    Two problems: the model needs more than the budget before any KV cache, or the pool holds
    fewer tokens than one `max_model_len` sequence.
    """
    if sizing.needed_bytes >= sizing.memory_budget_bytes or sizing.num_blocks <= 0:
        return (
            f"{sizing.model} needs {sizing.needed_bytes / GIB:.1f} GiB on {sizing.gpu} before any "
            f"KV cache (weights {sizing.weights_bytes / GIB:.1f} + activation "
            f"{sizing.activation_bytes / GIB:.1f} + other {sizing.other_bytes / GIB:.1f}, "
            f"{sizing.source}), budget is {sizing.memory_budget_bytes / GIB:.1f} GiB: raise "
            "cache.gpu_memory_utilization or cache.memory_budget_gib, or use a bigger GPU"
            + (" or more tensor-parallel GPUs (tensor_parallel_size)"
               if sizing.tensor_parallel_size < parallel.MAX_TENSOR_PARALLEL_SIZE else "")
        )
    if len(sizing.kv_groups) > 1 and sizing.blocks_per_request > sizing.num_blocks:
        return (
            f"pool holds {sizing.num_blocks} blocks of {sizing.block_size} tokens; a "
            f"max_model_len ({sizing.max_model_len}) request needs {sizing.blocks_per_request} "
            "over its KV groups: lower scheduler.max_model_len or raise the budget"
        )
    if max_model_len is not None and sizing.max_cached_tokens < max_model_len \
            and len(sizing.kv_groups) <= 1:
        return (
            f"pool holds {sizing.max_cached_tokens} tokens ({sizing.num_blocks} blocks of "
            f"{sizing.block_size}); max_model_len is {max_model_len}: lower "
            "scheduler.max_model_len or raise the budget"
        )
    return None
