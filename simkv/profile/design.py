"""The profiler's design: the step compositions it measures (pure Python, importable anywhere).

`design()` lists them in a fixed order (the fit's hold-out rule counts positions in it);
`features(items)` gives a composition's cost-model features as the scheduler computes them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

# KV tokens of the largest composition (75 GiB for an 8B): serving decode batches of 192-256
# sequences at 2,048 tokens of context reach 400,000-520,000 (docs/validation.md).
MAX_CACHED_TOKENS = 600_000
TOKEN_STRIDE = 997        # sequence i of a composition reads the token ids from i x 997 on


# ----------------------------------------------------------------------------------------------
# The design (pure Python)


@dataclass
class Point:
    """One step composition: items are (start, num_tokens, is_decode) per sequence."""

    id: str
    family: str
    items: list


def _decode(b: int, ctx: int) -> list:
    return [(ctx - 1, 1, True)] * b


def _chunks(n: int, tokens: int, prefix: int) -> list:
    return [(prefix, tokens, False)] * n


def _quick_grid(add) -> None:
    """The quick grid: a few small compositions of each family."""
    for b in (1, 4):
        for ctx in (16, 48):
            add(f"decode/b{b}/c{ctx}", "decode", _decode(b, ctx))
    add("decode/het/2x8+1x60", "decode", _decode(2, 8) + _decode(1, 60))
    for t in (8, 32):
        for p in (0, 24):
            add(f"prefill/1x{t}+p{p}", "prefill", _chunks(1, t, p))
    add("prefill/2x16+p0", "prefill", _chunks(2, 16, 0))
    for b in (2, 6):
        add(f"mixed/d{b}c24/1x16+p8", "mixed", _decode(b, 24) + _chunks(1, 16, 8))


def _decode_grid(add) -> None:
    """Decode batches: uniform contexts, long single sequences, heterogeneous batches."""
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        for ctx in (128, 512, 2048, 8192):
            add(f"decode/b{b}/c{ctx}", "decode", _decode(b, ctx))
    for b, ctx in ((1, 32768), (4, 32768), (1, 65536), (16, 16384)):
        add(f"decode/b{b}/c{ctx}", "decode", _decode(b, ctx))
    # Heterogeneous batches: one long sequence among short ones, halves, a geometric spread.
    for b, short, long_ in ((8, 64, 32768), (32, 256, 16384), (128, 512, 8192)):
        add(f"decode/het/{b - 1}x{short}+1x{long_}", "decode",
            _decode(b - 1, short) + _decode(1, long_))
    for b, a, c in ((16, 128, 4096), (64, 256, 2048), (200, 300, 1000)):
        add(f"decode/het/{b // 2}x{a}+{b - b // 2}x{c}", "decode",
            _decode(b // 2, a) + _decode(b - b // 2, c))
    for b in (12, 48, 160):
        ctxs = np.geomspace(32, 16384, b).round().astype(int).tolist()
        add(f"decode/het/{b}xgeom32-16384", "decode", [(c - 1, 1, True) for c in ctxs])



def _prefill_grid(add) -> None:
    """Prefill chunks, alone and several per step, with and without a cached prefix."""
    for t in (16, 64, 256, 512, 1024, 2048, 4096, 8192):
        for p in (0, 4096):
            add(f"prefill/1x{t}+p{p}", "prefill", _chunks(1, t, p))
    for t, p in ((512, 16384), (2048, 16384), (128, 32768)):
        add(f"prefill/1x{t}+p{p}", "prefill", _chunks(1, t, p))
    for n, t, p in ((4, 256, 0), (8, 512, 0), (16, 128, 0), (2, 2048, 1024), (32, 64, 0),
                    (4, 1024, 4096)):
        add(f"prefill/{n}x{t}+p{p}", "prefill", _chunks(n, t, p))



def _mixed_grid(add) -> None:
    """Decode batches with prefill chunks beside them, and the larger prefill chunks."""
    for b in (4, 16, 32, 64, 128):
        for i, t in enumerate((64, 512, 2048)):
            p = 0 if (i + b) % 2 == 0 else 2048
            add(f"mixed/d{b}c1024/1x{t}+p{p}", "mixed", _decode(b, 1024) + _chunks(1, t, p))
    add("mixed/d200c512/1x1848+p0", "mixed", _decode(200, 512) + _chunks(1, 1848, 0))
    add("mixed/d100c2048/1x412+p1024", "mixed", _decode(100, 2048) + _chunks(1, 412, 1024))
    add("mixed/d8c8192/1x4096+p8192", "mixed", _decode(8, 8192) + _chunks(1, 4096, 8192))
    add("mixed/d32c512/2x256+p0", "mixed", _decode(32, 512) + _chunks(2, 256, 0))
    add("mixed/d48c4096/1x1024+p0", "mixed", _decode(48, 4096) + _chunks(1, 1024, 0))
    add("mixed/d240c256/1x16+p4096", "mixed", _decode(240, 256) + _chunks(1, 16, 4096))
    add("mixed/d24c300/1x7000+p0", "mixed", _decode(24, 300) + _chunks(1, 7000, 0))
    # Mixed steps in the range of the captured mixed graphs (up to 1,024 tokens): a chunk's
    # tail beside a decode batch, as continuous serving schedules them.
    for b, ctx in ((1, 256), (8, 1024), (32, 512), (96, 1024), (200, 700)):
        for t, p in ((16, 0), (100, 512), (300, 0), (700, 2048), (1000 - b, 0)):
            if t > 1:
                add(f"mixed/d{b}c{ctx}/1x{t}+p{p}", "mixed", _decode(b, ctx) + _chunks(1, t, p))
    add("mixed/d16c800/3x200+p0", "mixed", _decode(16, 800) + _chunks(3, 200, 0))
    add("mixed/d64c2048/2x150+p300", "mixed", _decode(64, 2048) + _chunks(2, 150, 300))
    # Eager steps just above the largest mixed graph (1,024 tokens), where most serving prefill
    # steps fall; large chunks over long cached prefixes (Mooncake-like).
    for b, ctx in ((16, 1024), (64, 2048), (160, 1500)):
        for total, p in ((1100, 0), (1400, 1024), (1800, 0)):
            add(f"mixed/d{b}c{ctx}/1x{total - b}+p{p}", "mixed",
                _decode(b, ctx) + _chunks(1, total - b, p))
    for t, p in ((8192, 16384), (8192, 24576), (4096, 16384)):
        add(f"prefill/1x{t}+p{p}", "prefill", _chunks(1, t, p))
    add("mixed/d8c16384/1x8192+p16384", "mixed", _decode(8, 16384) + _chunks(1, 8192, 16384))


def _serving_like_grid(add) -> None:
    """Decode batches with serving-like contexts, and eager mixed steps between 1,024 and
    2,048 tokens."""
    # Serving-like decode batches: contexts drawn as Azure conv serving produces them (lognormal
    # around 900 tokens) with three long sequences first, spread through or last in the batch
    # (the decode kernel launches sequences in order, so a late long one is the kernel's tail),
    # and the same batch without them. Eager steps between 1,024 and 2,048 tokens, finer than
    # T_lin's knots (research/step_probes.py measures structure there). They come last in the
    # design, so the compositions before them keep their hold-out ranks.
    rng = np.random.default_rng(2026)
    longs = [4096, 5120, 6144]
    for b in (64, 150, 220):
        base = np.clip(rng.lognormal(np.log(900), 0.6, b - 3), 64, 3000).round().astype(int)
        base = base.tolist()
        q = len(base) // 3
        layouts = {"first": longs + base, "last": base + longs,
                   "spread": base[:q] + longs[:1] + base[q:2 * q] + longs[1:2] + base[2 * q:]
                   + longs[2:]}
        for where, ctxs in layouts.items():
            add(f"decode/mix/b{b}-long-{where}", "decode", [(c - 1, 1, True) for c in ctxs])
        add(f"decode/mix/b{b - 3}-no-long", "decode", [(c - 1, 1, True) for c in base])
    for total in (1216, 1344, 1536, 1664, 1856, 1984):     # (not 32 decodes: held out by rule)
        add(f"mixed/d24c1024/1x{total - 24}+p0", "mixed",
            _decode(24, 1024) + _chunks(1, total - 24, 0))


def _window_grid(add, window: int) -> None:
    """A model with sliding layers: its window layers read at most `window` tokens of each
    context, its full layers all of them. Decode batches and prefill chunks at contexts below,
    at and well past the window (and batches that mix both), so that the sliding layers' reads
    and pairs vary apart from the full layers'."""
    for b in (2, 16, 64, 128):
        for f in (0.5, 1, 3, 12):
            ctx = max(2, round(window * f))
            add(f"decode/win/b{b}/c{ctx}", "decode", _decode(b, ctx))
    for b in (32, 96):
        add(f"decode/win/het/{b // 2}x{window // 2}+{b // 2}x{window * 8}", "decode",
            _decode(b // 2, max(2, window // 2)) + _decode(b // 2, window * 8))
    for t, p in ((window, 0), (window, window * 4), (4 * window, 0), (2 * window, window * 8)):
        add(f"prefill/win/1x{t}+p{p}", "prefill", _chunks(1, t, p))
    for b, t, p in ((16, window, window * 4), (64, 256, window * 2)):
        add(f"mixed/win/d{b}c{window * 3}/1x{t}+p{p}", "mixed",
            _decode(b, window * 3) + _chunks(1, t, p))


def _expert_grid(add, num_experts: int, top_k: int) -> None:
    """A MoE model: a step's layers run the experts its tokens touch, E x (1 - (1 - k/E)^T)
    in expectation for T tokens, which grows fastest where T x k is below a few times E. Decode
    batches and small prefill chunks there, at token counts between the captured graph sizes
    (a graph's padding rows route as one more token) and between T_lin's knots."""
    saturated = max(2, math.ceil(4 * num_experts / top_k))   # nearly every expert touched
    counts = sorted({int(round(x)) for x in np.geomspace(3, saturated, 7)}
                    - {2 ** i for i in range(10)})         # not at a captured graph size
    for b in counts:
        add(f"decode/moe/b{b}/c512", "decode", _decode(b, 512))
        add(f"decode/moe/b{b}/c2048", "decode", _decode(b, 2048))
    for t in counts:
        if t >= 2:
            add(f"prefill/moe/1x{t}+p1024", "prefill", _chunks(1, t, 1024))
    for b, t in ((3, 20), (12, 40)):
        add(f"mixed/moe/d{b}c1024/1x{t}+p0", "mixed", _decode(b, 1024) + _chunks(1, t, 0))


def _serving_batch_grid(add) -> None:
    """Serving-sized decode batches (contexts drawn as Azure conv serving produces them,
    lognormal around 900 tokens) beside the prefill chunks that continuous batching puts next
    to them: one chunk inside the mixed graphs' range, and eager steps of 2,300 to 6,000 tokens
    in one or two chunks. The grid's other eager mixed steps hold few decodes; served eager
    steps of a MoE model hold 100-200 (docs/validation.md, qwen3-30b-a3b). Last of the dense
    grid, so the compositions before them keep their hold-out ranks."""
    rng = np.random.default_rng(2031)
    for b in (64, 128, 192):
        ctxs = np.clip(rng.lognormal(np.log(900), 0.6, b), 64, 3000).round().astype(int)
        decodes = [(int(c) - 1, 1, True) for c in ctxs]
        for total, n in ((1000, 1), (2300, 1), (3000, 2), (4500, 1), (6000, 2)):
            chunk = (total - b) // n
            add(f"mixed/serve/d{b}/{n}x{chunk}+p0", "mixed", decodes + _chunks(n, chunk, 0))


def design(quick: bool = False, max_cached_tokens: int = MAX_CACHED_TOKENS,
           window: int = 0, experts: tuple = (), max_model_len: int = 0) -> list:
    """The grid, in a fixed order (the fit's hold-out rule counts positions in it). `window`
    (a model with sliding layers) and `experts` ((num_experts, top_k) of a MoE model) append
    the window- and expert-aware compositions after the rest (the quick grid gets a few).
    `max_model_len`: compositions with a longer sequence are left out (0: none)."""
    points = []

    def add(pid, family, items):
        cached = sum(s + n for s, n, _ in items)
        too_long = max_model_len and max(s + n for s, n, _ in items) > max_model_len
        if cached <= max_cached_tokens and not too_long:
            points.append(Point(pid, family, items))

    grids = (_quick_grid,) if quick else (_decode_grid, _prefill_grid, _mixed_grid,
                                          _serving_like_grid, _serving_batch_grid)
    for grid in grids:
        grid(add)
    if quick:
        if window:
            for b, ctx in ((2, 2 * window), (4, 3 * window)):
                add(f"decode/win/b{b}/c{ctx}", "decode", _decode(b, ctx))
            add(f"prefill/win/1x{window}+p{2 * window}", "prefill", _chunks(1, window, 2 * window))
        if experts:
            for b in (2, 3, 6):
                add(f"decode/moe/b{b}/c24", "decode", _decode(b, 24))
        return points
    if window:
        _window_grid(add, window)
    if experts:
        _expert_grid(add, *experts)
    return points


def model_terms(model) -> dict:
    """What meta.json records of `model` (a ModelSpec) for the window and expert terms: the
    window where some layers slide, the routed experts and top-k where it has experts."""
    types = tuple(getattr(model, "attention_types", ()) or ())
    window = int(model.sliding_window or 0) if "sliding_attention" in types else 0
    e = model.experts if getattr(model, "is_moe", False) else None
    return {"sliding_window": window, "num_experts": int(e.num_experts) if e else 0,
            "experts_top_k": int(e.top_k) if e else 0}


def design_for(model, quick: bool = False, max_cached_tokens: int = MAX_CACHED_TOKENS) -> list:
    """The grid for `model` (a ModelSpec): its window and expert compositions where it has
    sliding layers or experts (model_terms), none longer than its max_position_embeddings."""
    terms = model_terms(model)
    experts = (terms["num_experts"], terms["experts_top_k"]) if terms["num_experts"] else ()
    return design(quick, max_cached_tokens, terms["sliding_window"], experts,
                  model.max_position_embeddings)


def _all_points(window: int = 0, experts: tuple = ()):
    for quick in (False, True):
        yield from design(quick, window=window, experts=experts)


@functools.lru_cache(maxsize=8)
def decode_contexts_by_id(window: int = 0, experts: tuple = ()) -> dict:
    """id -> the composition's decode context lengths in batch order, for the full and the quick
    grid (with a model's window and expert compositions): the order the decode kernel launches
    their programs in (the fit's in-order tail)."""
    out = {}
    for point in _all_points(window, experts):
        out.setdefault(point.id, tuple(s + 1 for s, _, is_decode in point.items if is_decode))
    return out


@functools.lru_cache(maxsize=8)
def prefill_chunks_by_id(window: int = 0, experts: tuple = ()) -> dict:
    """id -> the composition's prefill chunks (cached prefix, chunk tokens) of two or more
    tokens, in batch order, for the full and the quick grid (the fit's prefill tail; with a
    model's window and expert compositions)."""
    out = {}
    for point in _all_points(window, experts):
        out.setdefault(point.id, tuple((s, n) for s, n, is_decode in point.items
                                       if not is_decode and n >= 2))
    return out


def step_plan(items, block_size: int, tables=None, tokens=None):
    """A StepPlan of fresh sequences, one per item (start, num_tokens, is_decode), with the
    scheduler's features. `tables`: each sequence's block table (default: blocks numbered from
    0 in order, nothing shared); `tokens`: the real engine's token ids (None to only predict),
    sequence i reading them from i x TOKEN_STRIDE on: sequences at the same position then feed
    different tokens, so a MoE layer routes them as serving's different prompts do (one list
    for all made every sequence of a uniform batch pick the same top-k experts)."""
    from simkv.engine.plan import ScheduledSeq, StepPlan
    from simkv.engine.request import Sequence
    scheduled, used = [], 0
    for i, (start, n, is_decode) in enumerate(items):
        if tables is None:
            blocks = -(-(start + n) // block_size)
            table = list(range(used, used + blocks))
            used += blocks
        else:
            table = list(tables[i])
        ids = None
        if tokens is not None:      # each sequence its own window of the ids (see the docstring)
            offset = (i * TOKEN_STRIDE) % max(1, len(tokens) - (start + n) + 1)
            ids = tokens[offset:offset + start + n]
        seq = Sequence(seq_id=i, request=None, sample=0, num_tokens=start + n,
                       num_computed_tokens=start, block_table=table, token_ids=ids)
        scheduled.append(ScheduledSeq(seq, start, n, is_decode))
    plan = StepPlan(step=0, now_s=0.0, scheduled=scheduled)
    for key, value in features(items).items():
        if key != "num_decode_seqs":          # a property of the plan
            setattr(plan, key, value)
    return plan


def features(items) -> dict:
    """Cost-model features of a composition (as `Scheduler._finalise` computes them, but for
    `decode_shared_context_tokens`: a composition's sequences share no block)."""
    f = dict(num_prefill_tokens=0, num_decode_tokens=0, num_prefill_seqs=0, num_decode_seqs=0,
             decode_context_tokens=0, prefill_context_tokens=0, prefill_attention_pairs=0,
             decode_max_context=0)
    for start, n, is_decode in items:
        if is_decode:
            f["num_decode_tokens"] += 1
            f["num_decode_seqs"] += 1
            f["decode_context_tokens"] += start + 1
            f["decode_max_context"] = max(f["decode_max_context"], start + 1)
        else:
            f["num_prefill_tokens"] += n
            f["num_prefill_seqs"] += 1
            f["prefill_context_tokens"] += start + n
            f["prefill_attention_pairs"] += n * start + n * (n + 1) // 2
    return f
