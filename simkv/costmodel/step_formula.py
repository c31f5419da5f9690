"""The profiled step-cost formula: a step's features and fitted coefficients -> seconds.

Shared by the fit (`simkv.fitting.fit`, which fills in the coefficients from a profile's raw
CSVs) and the cost model the simulator runs (`simkv.costmodel.profiled`). The formula itself is
written out in `simkv.fitting.fit`'s docstring; `StepLayout` says how the engine lays a step
out beyond the plan's features (CUDA-graph sizes, the decode kernel's split rule).
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass

from simkv.costmodel.features import expected_experts_touched
from simkv.costmodel.roofline import window_pairs
from simkv.errors import InputError
from simkv.launch_policy import decode_num_splits

TOKEN_KNOTS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_KNOTS = (1, 16, 256)
LOG_BATCH_KNOTS = tuple(math.log2(k) for k in BATCH_KNOTS)
FORMS = {   # name -> decode attention's per-token cost interpolated between batch knots
    "base": False,
    "batch": True,
}


def hats(value: float, knots, extrapolate: bool = True) -> list:
    """Linear-interpolation weights of `value` on increasing `knots`.

    Below the first knot the first knot's value holds; above the last one the last segment is
    extended (or the last value holds, with `extrapolate=False`).
    """
    k = len(knots)
    w = [0.0] * k
    if k == 1 or value <= knots[0]:
        w[0] = 1.0
        return w
    if value >= knots[-1] and not extrapolate:
        w[-1] = 1.0
        return w
    i = 1
    while i < k - 1 and value > knots[i]:
        i += 1
    f = (value - knots[i - 1]) / (knots[i] - knots[i - 1])
    w[i - 1] = 1.0 - f
    w[i] = f
    return w


def token_knots_for(max_tokens: int) -> list:
    """TOKEN_KNOTS up to the first one at or above `max_tokens`."""
    knots = []
    for k in TOKEN_KNOTS:
        knots.append(k)
        if k >= max_tokens:
            break
    return knots


_num_splits = functools.lru_cache(maxsize=4096)(decode_num_splits)   # called every step
_touched = functools.lru_cache(maxsize=4096)(expected_experts_touched)


def listed_tail(programs: list, groups: int) -> float:
    """Tokens by which the last of `programs` (tokens each, in launch order) ends after an even
    share of them over `groups` slots, each program starting on the slot that frees first."""
    share = sum(programs) / groups
    if len(programs) <= groups:          # one wave: every program starts at once
        return max(0.0, max(programs) - share)
    free = programs[:groups]              # the group slots' finishing times
    heapq.heapify(free)
    for program in programs[groups:]:
        heapq.heapreplace(free, free[0] + program)
    return max(0.0, max(free) - share)


@dataclass(frozen=True)
class StepLayout:
    """How the engine lays a step out, beyond the plan's features: token knots of T_lin, the
    captured CUDA-graph sizes (decode-only steps by batch, steps with prefill chunks by token
    count), and the decode kernel's split rule (`simkv.launch_policy`: it splits each
    sequence's context over programs so that small batches fill the GPU; the longest program
    bounds the kernel when one sequence is much longer than the rest)."""

    token_knots: tuple
    graph_batch_sizes: tuple = ()
    sm_count: int = 0            # 0: unknown; the longest program is the longest sequence
    num_kv_heads: int = 1
    decode_tile: int = 64        # tokens per decode-kernel loop iteration
    max_model_len: int = 0       # graphed block tables are this wide
    mixed_token_sizes: tuple = ()  # token counts of the captured mixed steps (none: eager)
    max_num_seqs: int = 256      # a mixed graph of T tokens has min(T, max_num_seqs) decode rows
    decode_slots_per_sm: float = 0.0   # decode programs an SM runs at once (0: count the whole
                                       # busiest program)
    decode_tail_in_order: bool = False  # list-schedule the batch's programs in launch order
                                        # (else: the busiest program against an even share)
    num_heads: int = 0                 # query heads: the prefill kernel's programs per tile
    prefill_tile: int = 64             # query tokens per prefill-kernel program (BLOCK_M)
    prefill_slots_per_sm: float = 0.0  # prefill programs an SM runs at once (0: no prefill
                                       # tail term)
    sliding_window: int = 0            # tokens a sliding layer attends to (0: no such layers)
    num_experts: int = 0               # routed experts of a MoE layer (0: a dense model)
    experts_top_k: int = 0             # experts each token is routed to

    @property
    def has_window(self) -> bool:
        return self.sliding_window > 0

    @property
    def has_experts(self) -> bool:
        return self.num_experts > 0

    def window_decode_tokens(self, num_decode_seqs: int, context_tokens: int,
                             contexts=None) -> float:
        """Context tokens one sliding layer's decode reads: sum of min(c, window) over the
        decodes (`contexts`, any order); without them, min(context, decodes x window)."""
        w = self.sliding_window
        if not w or not num_decode_seqs:
            return 0.0
        if contexts is not None and len(contexts) == num_decode_seqs:
            return float(sum(c if c < w else w for c in contexts))
        return float(min(context_tokens, num_decode_seqs * w))

    def window_prefill_pairs(self, chunks, pairs: int = 0) -> float:
        """Query-key pairs of one sliding layer's prefill: per chunk (cached prefix, tokens),
        each query attends to itself and at most window - 1 tokens before it. Without the
        chunks, the full pairs (an upper bound)."""
        w = self.sliding_window
        if not w:
            return 0.0
        if chunks is None:
            return float(pairs)
        return float(sum(window_pairs(start, n, w) for start, n in chunks))

    def experts_touched(self, num_tokens: int, rows: int) -> float:
        """Expected distinct routed experts one MoE layer runs for a step of `num_tokens` tokens
        computed as `rows` rows (a CUDA graph's padding rows are one repeated token, routed as
        one more), under uniform routing (simkv.costmodel.features)."""
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        routed = num_tokens + (1 if rows > num_tokens else 0)
        return _touched(self.num_experts, self.experts_top_k, routed)

    def mixed_size(self, num_tokens: int) -> int:
        """The captured mixed-step size a step of `num_tokens` is padded to (0: runs eagerly)."""
        for size in self.mixed_token_sizes:
            if size >= num_tokens:
                return size
        return 0

    def is_graphed(self, num_prefill_tokens: int, num_decode_seqs: int) -> bool:
        """Whether the engine runs such a step as a CUDA graph."""
        if num_prefill_tokens:
            return bool(self.mixed_size(num_prefill_tokens + num_decode_seqs))
        return bool(self.graph_batch_sizes) and num_decode_seqs <= self.graph_batch_sizes[-1]

    def rows(self, num_tokens: int, graph: bool, mixed: bool = False) -> int:
        """Rows the linear layers compute: a graphed step is padded to its captured size."""
        if graph and mixed:
            return self.mixed_size(num_tokens) or num_tokens
        if graph:
            for size in self.graph_batch_sizes:
                if size >= num_tokens:
                    return size
        return num_tokens

    def longest_program_tokens(self, num_decode_seqs: int, max_context: int, graph: bool,
                               block_size: int, mixed_tokens: int = 0) -> int:
        """Context tokens the decode kernel's busiest program reads (0 without decodes).
        `mixed_tokens`: the step's tokens when it also has prefill chunks."""
        if not num_decode_seqs:
            return 0
        if not self.sm_count:
            return max_context
        splits = self.decode_splits(num_decode_seqs, max_context, graph, block_size, mixed_tokens)
        return self.program_tokens(max_context, splits)

    def program_tokens(self, context: int, splits: int) -> int:
        """Context tokens one program of a sequence of `context` tokens reads: its share of the
        sequence's tiles, in whole tiles (decode_tail_tokens inlines the same expression)."""
        span = self.decode_tile * splits
        return (context + span - 1) // span * self.decode_tile

    def decode_splits(self, num_decode_seqs: int, max_context: int, graph: bool,
                      block_size: int, mixed_tokens: int = 0) -> int:
        """Programs per sequence and KV head of the decode kernel (its split rule)."""
        if graph and mixed_tokens:
            batch = min(self.rows(mixed_tokens, True, True), self.max_num_seqs)
            width = -(-self.max_model_len // block_size) * block_size
        elif graph:
            batch = self.rows(num_decode_seqs, True)
            width = -(-self.max_model_len // block_size) * block_size
        else:       # eager tables are padded to a multiple of 16 blocks
            batch = num_decode_seqs
            width = -(-max_context // (16 * block_size)) * 16 * block_size
        return _num_splits(batch, self.num_kv_heads, width, self.decode_tile, self.sm_count)

    def tail_grouping(self, num_decode_seqs: int, max_context: int, graph: bool,
                      block_size: int, mixed_tokens: int = 0) -> tuple:
        """(span, tile, groups) of the in-order decode tail: a sequence of c context tokens
        runs programs of (c + span - 1) // span * tile tokens (`program_tokens`), its group
        of kv_heads x splits programs taking one of `groups` group slots."""
        splits = self.decode_splits(num_decode_seqs, max_context, graph, block_size,
                                    mixed_tokens)
        groups = max(1, round(self.decode_slots_per_sm * self.sm_count
                              / (self.num_kv_heads * splits)))
        return self.decode_tile * splits, self.decode_tile, groups

    def decode_tail_tokens(self, num_decode_seqs: int, max_context: int, context_tokens: int,
                           graph: bool, block_size: int, mixed_tokens: int = 0,
                           contexts=None) -> float:
        """Context tokens by which the decode kernel's last program ends after an even share of
        the batch's KV over the GPU's concurrent program slots (sm_count x
        decode_slots_per_sm): the tail that long sequences add when the rest of the batch
        cannot hide them. A uniform batch that fills the slots has no tail (its time is the KV
        read); 127 short sequences and one of 8,192 tokens wait for the long one's program.

        With `contexts` (the decode sequences' context lengths in batch order, the order the
        kernel launches their programs in), the programs are list-scheduled on the slots in
        that order: each starts on the slot that frees first, so a long sequence late in a
        batch that oversubscribes the slots ends later than the same one first, and a batch
        of uneven lengths leaves a ragged last wave. A sequence's kv_heads x splits programs
        are equally long and launched together, so they move as one group over slots / group
        "group slots" (exact when the group divides the slots). Only for a layout with
        `decode_tail_in_order` (a fit made with it) and contexts for every decode; otherwise
        the busiest program against the even share of the whole batch (the long one first)."""
        if (self.decode_tail_in_order and contexts is not None and num_decode_seqs
                and len(contexts) == num_decode_seqs and self.decode_slots_per_sm
                and self.sm_count):
            span, tile, groups = self.tail_grouping(num_decode_seqs, max_context, graph,
                                                    block_size, mixed_tokens)
            return listed_tail([(c + span - 1) // span * tile for c in contexts], groups)
        longest = self.longest_program_tokens(num_decode_seqs, max_context, graph, block_size,
                                              mixed_tokens)
        if not longest or not self.decode_slots_per_sm or not self.sm_count:
            return float(longest)
        share = self.num_kv_heads * context_tokens / (self.decode_slots_per_sm * self.sm_count)
        return max(0.0, longest - share)

    def decode_run_tail(self, starts: list, graph: bool, block_size: int):
        """`decode_tail_tokens` of the steps k = 1, 2, ... of a decode run (a generator): a
        batch whose sequence i has c_i + k context tokens in step k (`starts`: the c_i, in
        batch order); `decode_run_tail_segments`, step by step."""
        k = 1
        for value, until in self.decode_run_tail_segments(starts, graph, block_size):
            for _ in range(k, until):
                yield value
            k = until

    def decode_run_tail_segments(self, starts: list, graph: bool, block_size: int):
        """`decode_run_tail` as segments (a generator of (tokens, until)): the tail is `tokens`
        in the steps from the previous segment's `until` (step 1 for the first) up to `until`,
        not included. In order, a graphed batch's programs grow only where a context passes a
        multiple of the span, and the tail is taken again only there; otherwise each segment
        is one step."""
        n = len(starts)
        longest0, context0 = max(starts), sum(starts)
        k = 1
        if not (self.decode_tail_in_order and self.decode_slots_per_sm and self.sm_count):
            while True:
                yield self.decode_tail_tokens(n, longest0 + k, context0 + n * k, graph,
                                              block_size), k + 1
                k += 1
        grouping, value, valid_until = None, 0.0, 0
        fixed = self.tail_grouping(n, longest0 + 1, graph, block_size) if graph else None
        while True:         # a graphed batch's split rule does not read its longest context
            g = fixed or self.tail_grouping(n, longest0 + k, graph, block_size)
            if g != grouping:
                grouping, valid_until = g, k
            if k >= valid_until:
                span, tile, groups = g
                value = listed_tail([(c + k + span - 1) // span * tile for c in starts], groups)
                # the next step where a context becomes q x span + 1 (its programs grow): the
                # least (1 - c - k) % span, a 0 counting as span
                valid_until = k + 1 + min([(-c - k) % span for c in starts])
            until = valid_until if fixed else k + 1     # an eager batch's grouping may move
            yield value, until
            k = until

    def prefill_tail_tokens(self, chunks) -> float:
        """Key tokens by which the prefill kernel's busiest program reads beyond an even share
        of all its programs' keys over the GPU's slots (sm_count x prefill_slots_per_sm). One
        program takes `prefill_tile` query tokens of one chunk for one query head and reads the
        keys up to its last query (the cached prefix and the chunk so far), so a short chunk over
        a long prefix (128 tokens over 32,768: 2 tiles x 32 heads = 64 programs on 132 SMs) is
        as long as its busiest program, and a long chunk (16 tiles) fills the GPU. `chunks`:
        (cached prefix, chunk tokens) of the step's prefill chunks of two or more tokens."""
        if not (chunks and self.prefill_slots_per_sm and self.sm_count and self.num_heads):
            return 0.0
        tile, total, busiest = self.prefill_tile, 0, 0
        for start, n in chunks:
            tiles = -(-n // tile)
            total += tiles * start + tile * (tiles - 1) * tiles // 2 + n
            busiest = max(busiest, start + n)
        share = self.num_heads * total / (self.prefill_slots_per_sm * self.sm_count)
        return max(0.0, busiest - share)

    def to_json(self) -> dict:
        """The layout as fit.json holds it (the model's window and expert fields only where
        set: a dense full-attention fit reads as before)."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        for key in ("sliding_window", "num_experts", "experts_top_k"):
            if not out[key]:
                del out[key]
        return out


def model_terms_of(meta: dict) -> dict:
    """The layout fields a profile's model brings (sliding window, experts), from meta.json's
    `model_terms` (simkv.profile.design.model_terms); a profile without them was made before
    the terms, of a dense full-attention model: none."""
    terms = meta.get("model_terms")
    if isinstance(terms, dict):
        return {k: int(terms.get(k) or 0) for k in ("sliding_window", "num_experts",
                                                     "experts_top_k")}
    return {}


def layout_from_meta(meta: dict, max_tokens: int) -> StepLayout:
    """The StepLayout of a profile (meta.json), with documented defaults for older profiles."""
    shape = meta.get("model_shape") or {}
    head_dim = int(shape.get("head_dim", 128))
    tile = meta.get("decode_tile") or (64 if head_dim <= 128 and meta.get("dtype", "bfloat16")
                                       in ("bfloat16", "float16") else 32)
    max_len = meta.get("max_model_len")
    if not max_len and meta.get("model"):
        try:
            from simkv.specs import load_model
            max_len = load_model(meta["model"]).max_position_embeddings
        except InputError:
            max_len = 0
    return StepLayout(token_knots=tuple(token_knots_for(max_tokens)),
                      num_heads=int(shape.get("num_heads", 0)),
                      prefill_tile=int(meta.get("prefill_tile") or 64),
                      graph_batch_sizes=tuple(sorted(int(b) for b in
                                                     meta.get("graph_batch_sizes") or [])),
                      sm_count=int(meta.get("sm_count") or 0),
                      num_kv_heads=int(shape.get("num_kv_heads", 1)),
                      decode_tile=int(tile), max_model_len=int(max_len or 0),
                      mixed_token_sizes=tuple(sorted(int(t) for t in
                                                     meta.get("mixed_token_sizes") or [])),
                      max_num_seqs=int(meta.get("max_num_seqs") or 256),
                      **model_terms_of(meta))


def predict_step(coefs: dict, f, layout: StepLayout, block_size: int) -> float:
    """Seconds of one forward step from packed coefficients (see the module docstring)."""
    n = f["num_prefill_tokens"] + f["num_decode_tokens"]
    if n == 0:
        return 0.0
    graph = bool(f["graph"])
    mixed = n if f["num_prefill_tokens"] else 0
    b = f["num_decode_seqs"]
    seqs = b + f["num_prefill_seqs"]
    seconds = sum(w * v for w, v in zip(hats(layout.rows(n, graph, bool(mixed)),
                                             layout.token_knots),
                                        coefs["t_linear_s"]))
    a_dec = coefs["a_decode_s_per_token"]
    if len(a_dec) == 1:
        seconds += a_dec[0] * f["decode_context_tokens"]
    elif b:
        w = hats(math.log2(b), LOG_BATCH_KNOTS, False)
        seconds += sum(wi * ai for wi, ai in zip(w, a_dec)) * f["decode_context_tokens"]
    seconds += coefs.get("a_decode_longest_s_per_token", 0.0) * layout.decode_tail_tokens(
        b, f["decode_max_context"], f["decode_context_tokens"], graph, block_size, mixed,
        f.get("decode_contexts"))
    seconds += coefs["a_prefill_s_per_pair"] * f["prefill_attention_pairs"]
    seconds += coefs["a_prefill_ctx_s_per_token"] * f["prefill_context_tokens"]
    seconds += coefs.get("a_prefill_tail_s_per_token", 0.0) * layout.prefill_tail_tokens(
        f.get("prefill_chunks"))
    seconds += coefs["c_seq_s"] * seqs
    if graph and mixed:
        seconds += coefs.get("c_mixed_seq_s", 0.0) * b + coefs.get("c_mixed_s", 0.0)
    if mixed:
        seconds += coefs.get("c_prefill_row_s", 0.0) * layout.rows(n, graph, True)
    seconds += window_seconds(coefs, f, layout)
    seconds += coefs.get("a_expert_s", 0.0) * layout.experts_touched(
        n, layout.rows(n, graph, bool(mixed)))
    if graph:
        return seconds
    seconds += coefs["c_eager_s"]
    return max(seconds, coefs["host_floor_s"] + coefs["host_floor_s_per_seq"] * seqs)


def window_seconds(coefs: dict, f, layout: StepLayout) -> float:
    """The sliding layers' attention (the `window_attention` term): their decode reads and
    prefill pairs, each bounded by the window (the full layers' are in the decode and prefill
    terms, which count every context token and pair)."""
    if not layout.has_window:
        return 0.0
    seconds = 0.0
    a = coefs.get("a_window_decode_s_per_token", 0.0)
    if a and f["num_decode_seqs"]:
        seconds += a * layout.window_decode_tokens(f["num_decode_seqs"],
                                                   f["decode_context_tokens"],
                                                   f.get("decode_contexts"))
    a = coefs.get("a_window_prefill_s_per_pair", 0.0)
    if a and f["num_prefill_tokens"]:
        seconds += a * layout.window_prefill_pairs(f.get("prefill_chunks"),
                                                   f["prefill_attention_pairs"])
    return seconds


def transfer_seconds(coefs: dict, num_blocks: int, bytes_per_block: float) -> float:
    if num_blocks == 0:
        return 0.0
    return coefs["c0_s"] + coefs["c_block_s"] * num_blocks \
        + coefs["c_byte_s"] * num_blocks * bytes_per_block


def engine_host_seconds(coefs: dict | None, num_seqs: int, num_prefill_tokens: int) -> float:
    if not coefs:
        return 0.0
    return coefs["c0_s"] + coefs["c_seq_s"] * num_seqs \
        + coefs["c_prefill_token_s"] * num_prefill_tokens
