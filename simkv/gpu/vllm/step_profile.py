"""vLLM's own step times: controlled compositions served by vLLM's engine, as a simkv profile.

    python -m simkv.gpu.vllm.step_profile measure SCENARIO --out DIR [--budget-s S]   # GPU
    python -m simkv.gpu.vllm.step_profile build RAW.json --out PROFILE_DIR            # CPU
    simkv fit profile PROFILE_DIR                                                     # CPU

One engine (the scenario's settings, as `simkv validate --engine vllm` builds it) serves phases
of requests whose schedule is known in advance, so that every step's composition (which prompt
chunks, which decodes at which context) follows from vLLM's per-step token counts alone:

- ladder `decode-c<C>-b<B>`: B prompts of C tokens at once; once the last prefill is done, the
  decode batch halves every STAGE_STEPS steps (B, B/2, ..., 1) by each request's max_tokens.
  The prefill steps before it are full chunked-prefill steps (8,192 tokens with the decodes of
  the requests already prefilled), at contexts up to C.
- injection `inject-b<B>`: B requests of 512 prompt tokens decode while single prompts of P
  tokens (1 output token) arrive one after another: each makes one step of P prefill tokens
  and B decodes (chunked when P + B exceeds the token budget).
- burst `burst-p<P>-n<N>`: N prompts of P tokens, one output token each, at once: steps of
  prefill only, the last one short.

vLLM's scheduler (v1, chunked prefill, no preemption here) serves the running requests first,
one token per decode, then the waiting prompts in arrival order, chunked to the token budget:
so the prefill tokens of consecutive steps walk through the prompts in order, and request j,
whose prompt ends in step p_j, decodes in steps p_j + 1 ... p_j + max_tokens_j - 1.
`reconstruct` replays that from the logged token counts and checks every step's decode count;
a phase stops at its first step that disagrees.

A step's time comes from the engine core's output timestamps (EngineCoreOutputs.timestamp,
taken when a step's sampled tokens reach the host); vLLM's own per-step "elapsed" figure is the
host's wait only. With asynchronous scheduling the next step is already queued, so the period
between consecutive timestamps is the step's time on the GPU plus the host time it could not
hide, but single periods are shifted between neighbours, and a row keeps the total of the
periods it stands for:

- decode-only steps of one batch (a ladder stage, the stretch between two injections): the
  median period, at the middle step's composition (leaving out the step before a prefill step
  and the two after it);
- a prefill step inside a decode stream (an injection): the engine core releases the decode
  before it late and the ones after it early, so its time is the window from the decode before
  it to the second one after it, less those three decodes at their stream's median (shared by
  the window's prefill steps, a chunked prompt's two, in proportion to their own periods);
- consecutive full-budget prefill steps (a ladder's prefills, a burst): the engine core
  releases them in bunches (two at once, then a long gap), so blocks of about BLOCK_STEPS of
  them make one row each: their mean period at their mean composition (they differ only in a
  few decodes and in their chunks' offsets, terms the fitted formula takes linearly). Other
  prefill steps outside a decode stream are left out, and so is the first step of each phase
  (after idle, it has no period).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

STAGE_STEPS = 16            # decode steps per ladder stage
BLOCK_STEPS = 16            # full-budget prefill steps per row (about)
FULL_BUDGET_SHARE = 0.9     # a step of at least this share of the token budget is full
INJECT_PROMPT_TOKENS = 512  # the injection phases' decoding requests
INJECT_SIZES = (16, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)
INJECT_REPEATS = 3
INJECT_GAP_S = 0.02         # between one injected request's end and the next one's arrival
MIX_SIZES = (256, 512, 640, 768, 896, 1024, 1152, 1536, 2048)   # `mix` phases' prompts
MIX_REPEATS = 5
MIX_GAP_S = (0.045, 0.085)  # after an injected prompt's first token, the next one's arrival
MIX_SPREAD = (600, 900, 1200, 1500, 1800, 2100)  # `mix` context 0: prompts of these, in turn
WARMUP = (16, 1024, 8)      # requests, prompt tokens, output tokens
RAW_FORMAT = "simkv-vllm-step-profile-raw-1"
DRIVER = "simkv.gpu.vllm.step_profile 1"

# Phases in the order they run (the most useful first: a time budget cuts the tail).
# ("ladder", C, B) | ("inject", B) | ("burst", P, N)
PHASES = (
    ("inject", 1), ("inject", 32),
    ("ladder", 1024, 256), ("ladder", 16384, 32),
    ("inject", 8), ("inject", 96),
    ("ladder", 4096, 128), ("ladder", 256, 256), ("ladder", 32768, 16),
    ("burst", 1024, 20), ("burst", 3000, 6), ("burst", 500, 40), ("burst", 100, 150),
    ("ladder", 2048, 256), ("ladder", 8192, 64), ("ladder", 65536, 8),
    ("ladder", 1024, 256),          # again: the run-to-run spread of the same compositions
)

# Prompts in decode streams as a trace has them (`--phases mix`): ("mix", B, C, O): B requests
# of C prompt tokens (C = 0: MIX_SPREAD's lengths in turn) decode while single prompts of
# MIX_SIZES (shuffled, MIX_REPEATS each) arrive at random points of a step, each MIX_GAP_S
# after the previous one's first token, and decode O tokens (O > 1: they join the batch).
MIX_PHASES = (
    ("mix", 40, 1536, 32), ("mix", 40, 512, 1), ("inject", 32), ("mix", 40, 1536, 1),
    ("mix", 40, 512, 32), ("mix", 48, 0, 32), ("mix", 8, 512, 1), ("mix", 64, 2048, 32),
    ("mix", 16, 1024, 32), ("inject", 8), ("ladder", 1024, 256), ("mix", 1, 512, 1),
    ("ladder", 2048, 256),
)
PHASE_SETS = {"profile": PHASES, "mix": MIX_PHASES}


def phase_name(spec: tuple) -> str:
    kind = spec[0]
    if kind == "ladder":
        return f"decode-c{spec[1]}-b{spec[2]}"
    if kind == "inject":
        return f"inject-b{spec[1]}"
    if kind == "mix":
        return f"mix-b{spec[1]}-c{spec[2] or 'spread'}-o{spec[3]}"
    return f"burst-p{spec[1]}-n{spec[2]}"


# -- vLLM's schedule of a phase (no vLLM here) -----------------------------------------------

@dataclass
class Step:
    """One step of a phase: its prefill chunks (request, start, tokens) and decodes (request,
    context after the step)."""

    chunks: list = field(default_factory=list)
    decodes: list = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.chunks)

    def items(self) -> list:
        """(start, tokens, is_decode) per sequence, as simkv.profile.design.features takes."""
        return ([(start, n, False) for _, start, n in self.chunks]
                + [(context - 1, 1, True) for _, context in self.decodes])


class Replay:
    """vLLM's schedule of requests (prompt tokens, max_tokens) in arrival order, one step at a
    time: `step(prefill_tokens)` takes that many prompt tokens in order and returns the Step
    (with the decodes of every request prefilled before it and not yet finished)."""

    def __init__(self, requests: list):
        self.prompts = [int(p) for p, _ in requests]
        self.outputs = [int(m) for _, m in requests]
        self.done_at = [None] * len(requests)     # p_j: the step that ends request j's prompt
        self.cur, self.off, self.k = 0, 0, 0
        self.active: list = []                    # prefilled, still decoding, in order

    def decode_count(self) -> int:
        """Decodes of the next step."""
        k = self.k + 1
        return sum(1 for j in self.active if k <= self.done_at[j] + self.outputs[j] - 1)

    def step(self, prefill_tokens: int) -> Step:
        self.k += 1
        k, out = self.k, Step()
        self.active = [j for j in self.active if k <= self.done_at[j] + self.outputs[j] - 1]
        out.decodes = [(j, self.prompts[j] + k - self.done_at[j]) for j in self.active]
        need = int(prefill_tokens)
        while need > 0:
            if self.cur >= len(self.prompts):
                raise ValueError(f"step {k}: {need} prefill tokens beyond the phase's prompts")
            take = min(need, self.prompts[self.cur] - self.off)
            out.chunks.append((self.cur, self.off, take))
            self.off += take
            need -= take
            if self.off == self.prompts[self.cur]:
                self.done_at[self.cur] = k
                if self.outputs[self.cur] > 1:
                    self.active.append(self.cur)
                self.cur, self.off = self.cur + 1, 0
        return out

    @property
    def prompts_left(self) -> int:
        return sum(self.prompts[self.cur:]) - self.off


def predict(requests: list, budget: int, max_seqs: int = 256, *,
            until_prefilled: bool = False) -> list:
    """The Steps vLLM's scheduler takes for `requests`, all waiting at the start: decodes
    first, then prompt tokens in order up to `budget` tokens in all, a new prompt only while
    fewer than `max_seqs` requests run. `until_prefilled`: stop after the last prompt token."""
    replay, steps = Replay(requests), []
    while replay.prompts_left or (replay.decode_count() and not until_prefilled):
        decodes = replay.decode_count()
        running = decodes + (1 if replay.off else 0)
        tokens, left, j, off = 0, budget - decodes, replay.cur, replay.off
        while left > 0 and j < len(replay.prompts):
            if off == 0:
                if running >= max_seqs:
                    break
                running += 1
            take = min(left, replay.prompts[j] - off)
            tokens, left = tokens + take, left - take
            j, off = (j + 1, 0) if off + take == replay.prompts[j] else (j, off + take)
        steps.append(replay.step(tokens))
    return steps


def ladder_requests(context: int, batch: int, budget: int, stage_steps: int = STAGE_STEPS,
                    max_seqs: int = 256) -> list:
    """(prompt tokens, max_tokens) of a decode ladder: `batch` prompts of `context` tokens;
    after the last prefill the batch halves every `stage_steps` steps down to 1."""
    replay = Replay([(context, 10 ** 6)] * batch)
    for s in predict([(context, 10 ** 6)] * batch, budget, max_seqs, until_prefilled=True):
        replay.step(s.num_prefill_tokens)
    end = replay.k                                  # the step of the last prefill
    sizes = []
    b = batch
    while b >= 1:
        sizes.append(b)
        b //= 2
    finish = [None] * batch          # the requests prefilled first finish first
    j = 0
    for stage, size in enumerate(sizes):
        leaving = size - (sizes[stage + 1] if stage + 1 < len(sizes) else 0)
        for _ in range(leaving):
            finish[j] = end + (stage + 1) * stage_steps
            j += 1
    return [(context, finish[j] - replay.done_at[j] + 1) for j in range(batch)]


def burst_requests(prompt: int, count: int) -> list:
    return [(prompt, 1)] * count


def mix_plan(batch: int, context: int, outputs: int, seed: int) -> tuple:
    """(decoding requests, injected prompts' sizes in arrival order, gaps s) of a `mix` phase:
    the same for the same arguments."""
    import random
    rng = random.Random(f"{seed}-{batch}-{context}-{outputs}")
    base = [(context or MIX_SPREAD[j % len(MIX_SPREAD)], 10 ** 5) for j in range(batch)]
    sizes = [s for s in MIX_SIZES for _ in range(MIX_REPEATS)]
    rng.shuffle(sizes)
    gaps = [rng.uniform(*MIX_GAP_S) for _ in sizes]
    return base, [(s, int(outputs)) for s in sizes], gaps


# -- a phase's records -> profile rows (no vLLM here) ----------------------------------------

def reconstruct(requests: list, steps: list) -> tuple:
    """(Steps, note) of a recorded phase: `steps` are the logged dicts in order (only those with
    tokens count). Stops at the first step whose logged decode count is not the replay's (the
    note says where; None when every step agreed)."""
    replay, out = Replay(requests), []
    for i, s in enumerate(steps, start=1):
        try:
            step = replay.step(int(s["num_prefill_tokens"]))
        except ValueError as e:
            return out, str(e)
        if len(step.decodes) != int(s["num_decode_tokens"]):
            return out, (f"step {i}: {s['num_decode_tokens']} decodes logged, "
                         f"{len(step.decodes)} replayed")
        out.append(step)
    return out, None


def step_features(step: Step) -> dict:
    from simkv.profile.design import features
    return features(step.items())


def graphed(f: dict, full_sizes: list, piecewise_sizes: list) -> int:
    """Whether vLLM ran the step from a CUDA graph (as simkv's layout reads its sizes): decode
    only up to the largest full-graph batch; with prefill, up to the largest piecewise size."""
    tokens = f["num_prefill_tokens"] + f["num_decode_tokens"]
    if f["num_prefill_tokens"]:
        return int(bool(piecewise_sizes) and tokens <= max(piecewise_sizes))
    return int(bool(full_sizes) and f["num_decode_seqs"] <= max(full_sizes))


def _family(f: dict) -> str:
    if not f["num_prefill_tokens"]:
        return "decode"
    return "mixed" if f["num_decode_seqs"] else "prefill"


def _row(phase, i, f, value, times, timing, periods, block_size, full_sizes, piecewise_sizes,
         clock) -> dict:
    return {"id": f"vllm/{phase['name']}/s{i + 1}", "family": _family(f),
            "block_size": block_size, **f,
            "graph": graphed(f, full_sizes, piecewise_sizes), "time_s": value,
            "time_p10_s": times[int(0.1 * (len(times) - 1))],
            "time_p90_s": times[int(math.ceil(0.9 * (len(times) - 1)))],
            "reps": len(times), "period_s": periods[i], "timing": timing,
            "phase": phase["name"], "step": i + 1, "clock": clock}


def phase_rows(phase: dict, block_size: int, full_sizes: list, piecewise_sizes: list,
               budget: int = 8192) -> tuple:
    """(rows of steps.csv, phase summary) of one recorded phase (`budget`: the engine's
    max_num_batched_tokens)."""
    records = phase["steps"]
    real = [i for i, s in enumerate(records)
            if int(s["num_prefill_tokens"]) + int(s["num_decode_tokens"]) > 0]
    logged = [records[i] for i in real]
    steps, note = reconstruct([tuple(r) for r in phase["requests"]], logged)
    clock = "core_t_s" if all(s.get("core_t_s") is not None for s in records) else "t_s"
    # a step's period runs from the record just before it, if that one was a step with tokens
    # too (an empty step between them may have left the GPU idle)
    periods = [None] + [float(records[real[k]][clock]) - float(records[real[k] - 1][clock])
                        if real[k] - 1 == real[k - 1] else None for k in range(1, len(steps))]
    timed = [p is not None and p > 0 for p in periods]
    decode = [not step.chunks for step in steps]
    # runs of decode-only steps of one batch (the same requests), and the steps between them
    runs, last_key = [], None
    for i, step in enumerate(steps):
        key = tuple(j for j, _ in step.decodes) if decode[i] else "prefill"
        if key == last_key:
            runs[-1].append(i)
        else:
            runs.append([i])
        last_key = key
    run_of = {i: r for r in runs for i in r if decode[i]}
    median = {}
    for r in runs:
        if not decode[r[0]]:
            continue
        # the step before a prefill step and the two after it carry part of its time (below)
        clean = [i for i in r if timed[i] and not (i + 1 < len(steps) and not decode[i + 1])
                 and not any(0 <= i - d and not decode[i - d] for d in (1, 2))]
        use = clean if len(clean) >= 2 else [i for i in r if timed[i]]
        if use:
            median[r[0]] = (statistics.median(periods[i] for i in use), use, len(clean) >= 2)
    time_of, how, blocks = {}, {}, []
    for r in runs:
        if decode[r[0]]:
            continue
        i0, i1 = r[0], r[-1]
        inside = list(range(i0 - 1, i1 + 3))
        # a prefill step inside a decode stream: the engine core releases the step before it
        # late and the ones after it early (its host work is not hidden); the window from the
        # decode step before it to the second one after it, less those three decodes at their
        # stream's median, is its time (shared by the prefill steps of the window in
        # proportion to their own periods)
        if (i0 >= 2 and i1 + 2 < len(steps) and all(timed[i] for i in inside)
                and decode[i0 - 1] and decode[i1 + 1] and decode[i1 + 2]
                and run_of[i1 + 1] is run_of[i1 + 2]
                and run_of[i0 - 1][0] in median and run_of[i1 + 1][0] in median):
            # a decode run's median stands for its decodes when it comes from periods that no
            # prefill step shifted; a run too short for that (a request that finished or
            # joined just before or after the prompt) takes the other side's (one sequence
            # apart), and with neither clean the prompt has no window
            _, _, clean_before = median[run_of[i0 - 1][0]]
            _, _, clean_after = median[run_of[i1 + 1][0]]
            before = median[run_of[i0 - 1 if clean_before else i1 + 1][0]][0]
            after = median[run_of[i1 + 1 if clean_after else i0 - 1][0]][0]
            total = (sum(periods[i] for i in inside) - before - 2 * after
                     if clean_before or clean_after else 0.0)
            own = sum(periods[i] for i in r)
            if total > 0 and own > 0:
                for i in r:
                    time_of[i], how[i] = total * periods[i] / own, "window"
                continue
        # elsewhere the engine core releases prefill steps in bunches (two at once, then a
        # long gap), so one period says little; a block of consecutive full-budget steps keeps
        # its total: a row of their mean period and mean composition (the steps of a block
        # differ only in a few decodes or in their chunks' offsets, terms the formula takes
        # linearly). Shorter prefill steps outside a decode stream are left out.
        full = [i for i in r if timed[i] and steps[i].num_prefill_tokens + len(steps[i].decodes)
                >= FULL_BUDGET_SHARE * budget]
        runs_full, block = [], []
        for i in full:
            if block and i != block[-1] + 1:
                runs_full.append(block)
                block = []
            block.append(i)
        if block:
            runs_full.append(block)
        for run in runs_full:
            count = max(1, round(len(run) / BLOCK_STEPS))
            for k in range(count):
                part = run[k * len(run) // count:(k + 1) * len(run) // count]
                blocks.append(part)
    rows = []
    for r in runs:
        if decode[r[0]]:
            if r[0] not in median:
                continue
            value, use, _ = median[r[0]]
            times = sorted(periods[i] for i in use)
            f = step_features(steps[use[len(use) // 2]])
            rows.append(_row(phase, use[len(use) // 2], f, value, times, "median", periods,
                             block_size, full_sizes, piecewise_sizes, clock))
        else:
            for i in r:
                if i in time_of:
                    rows.append(_row(phase, i, step_features(steps[i]), time_of[i],
                                     [time_of[i]], how[i], periods, block_size, full_sizes,
                                     piecewise_sizes, clock))
    for part in blocks:
        feats = [step_features(steps[i]) for i in part]
        f = {k: sum(x[k] for x in feats) / len(feats) for k in feats[0]}
        times = sorted(periods[i] for i in part)
        row = _row(phase, part[len(part) // 2], f, sum(times) / len(times), times, "block",
                   periods, block_size, full_sizes, piecewise_sizes, clock)
        row["id"] = f"vllm/{phase['name']}/s{part[0] + 1}-{part[-1] + 1}"
        row["graph"] = graphed(feats[0], full_sizes, piecewise_sizes)
        rows.append(row)
    rows.sort(key=lambda x: x["step"])
    summary = {"name": phase["name"], "requests": len(phase["requests"]),
               "steps_logged": len(logged), "steps_replayed": len(steps), "rows": len(rows),
               "stopped": note, "wall_s": phase.get("wall_s"), "clock": clock}
    return rows, summary


STEP_CSV_COLUMNS = ("id", "family", "block_size", "num_prefill_tokens", "num_decode_tokens",
                    "num_prefill_seqs", "num_decode_seqs", "decode_context_tokens",
                    "prefill_context_tokens", "prefill_attention_pairs", "decode_max_context",
                    "graph", "time_s", "time_p10_s", "time_p90_s", "reps", "period_s", "timing",
                    "phase", "step")


MERGE_KEYS = ("model", "gpu", "vllm_num_gpu_blocks", "full_graph_sizes",
              "piecewise_graph_sizes", "async_scheduling")


def merge_raws(raws: list, names: list | None = None) -> dict:
    """One raw record of several measured with the same engine settings (another machine,
    other phases): the phases of all in order, a phase name seen before taking the next
    `-r<k>` suffix, the first record's meta with each record's date, command and phases under
    `sources`. Raises ValueError where the engines differ (naming the record by `names`)."""
    names = names or [f"raw record {k + 1}" for k in range(len(raws))]
    first = raws[0]["meta"]
    settings = {k: v for k, v in first["engine_kwargs"].items() if k != "model"}
    merged = {"format": RAW_FORMAT, "meta": dict(first), "phases": []}
    seen, sources = {}, []
    for k, raw in enumerate(raws):
        m = raw["meta"]
        for key in MERGE_KEYS:
            if m.get(key) != first.get(key):
                raise ValueError(f"{names[k]}: {key} {m.get(key)!r} differs from "
                                 f"{names[0]}'s {first.get(key)!r}")
        other = {key: v for key, v in m["engine_kwargs"].items() if key != "model"}
        if other != settings:
            diff = sorted(key for key in set(other) | set(settings)
                          if other.get(key) != settings.get(key))
            raise ValueError(f"{names[k]}: engine settings {', '.join(diff)} differ from "
                             f"{names[0]}'s")
        kept = []
        for phase in raw["phases"]:
            base = phase["name"].split("-r")[0] if "-r" in phase["name"] else phase["name"]
            seen[base] = seen.get(base, 0) + 1
            name = base + (f"-r{seen[base]}" if seen[base] > 1 else "")
            merged["phases"].append(dict(phase, name=name))
            kept.append(name)
        sources.append({"date": m.get("date"), "command": m.get("command"),
                        "measure_s": m.get("measure_s"), "versions": m.get("versions"),
                        "phases": kept})
    merged["meta"]["sources"] = sources
    return merged


def build_profile(raw: dict, out_dir, raw_path: str = "") -> dict:
    """steps.csv and meta.json (the profile layout `simkv fit profile` reads) from a raw
    record; returns the meta."""
    import pandas as pd
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = raw["meta"]
    block_size = int(m["engine_kwargs"]["block_size"])
    full, piecewise = m["full_graph_sizes"], m["piecewise_graph_sizes"]
    rows, phases = [], []
    for phase in raw["phases"]:
        r, summary = phase_rows(phase, block_size, full, piecewise,
                                int(m["engine_kwargs"].get("max_num_batched_tokens", 8192)))
        rows += r
        phases.append(summary)
    df = pd.DataFrame(rows)
    df[list(STEP_CSV_COLUMNS)].to_csv(out / "steps.csv", index=False, float_format="%.7g")
    from simkv.specs import load_model
    model = load_model(m["model"])
    shape = {k: getattr(model, k) for k in ("num_layers", "num_heads", "num_kv_heads",
                                            "head_dim", "hidden_size", "intermediate_size",
                                            "vocab_size")}
    meta = {
        "model": m["model"], "gpu": m["gpu"], "engine": "vllm",
        "model_shape": shape, "kv_bytes_per_token": model.kv_bytes_per_token("bf16"),
        "dtype": "bfloat16", "kv_dtype": "bf16", "block_sizes": [block_size],
        # vLLM's captured sizes: full graphs for decode-only batches, piecewise graphs for
        # steps with prefill (simkv's layout: graph_batch_sizes, mixed_token_sizes)
        "graph_batch_sizes": full, "mixed_token_sizes": piecewise,
        "max_num_seqs": int(m["engine_kwargs"]["max_num_seqs"]),
        "max_model_len": int(m["engine_kwargs"]["max_model_len"]),
        # simkv's layout splits each decode over programs by its own kernel's rule
        # (sm_count); vLLM's FlashAttention 3 splits by its own, so the layout leaves the SM
        # count out and the formula's decode tail reads the longest context
        "sm_count": 0, "device_sm_count": m.get("sm_count"),
        "date": m["date"], "command": m["command"],
        "build_command": f"python -m simkv.gpu.vllm.step_profile build {raw_path} --out {out}",
        "versions": m["versions"], "nvidia_smi": m.get("nvidia_smi"),
        "engine_kwargs": m["engine_kwargs"], "vllm_num_gpu_blocks": m["vllm_num_gpu_blocks"],
        "setup": m.get("setup"),
        **({"sources": m["sources"]} if "sources" in m else {}),
        "timing": ("the engine core's output timestamps (EngineCoreOutputs.timestamp) of "
                   "consecutive steps; rows keep the total of the periods they stand for: a "
                   "decode run of one batch its median period (reps: the periods used, "
                   "p10/p90 beside it), a prefill step inside a decode stream the window from "
                   "the decode before it to the second after it less those decodes "
                   "('window'), consecutive full-budget prefill steps in blocks of about "
                   f"{BLOCK_STEPS} their mean period at their mean composition ('block'); "
                   "the first step of each phase (after idle) and shorter prefill steps "
                   "outside a decode stream left out (simkv.gpu.vllm.step_profile)"),
        "host_terms": ("none: the periods hold every host cost vLLM did not hide, so the fit "
                       "has no engine_host term"),
        "phases": phases,
        "rows": len(df),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# -- on the GPU ------------------------------------------------------------------------------

def _logger_class():
    """A stat logger that appends one dict per engine step to `sink.steps`, with the engine
    core's output timestamp of that step (`core_t_s`) where the tap saw it."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0, sink=None):
            self.sink = sink

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0):
            if scheduler_stats is None:
                return
            sink = self.sink
            details = scheduler_stats.iteration_details
            core = sink.core_ts if sink.core_stats is scheduler_stats else None
            sink.steps.append({
                "t_s": time.monotonic() - sink.t0,
                "core_t_s": None if core is None else core - sink.t0,
                "num_running": scheduler_stats.num_running_reqs,
                "num_waiting": scheduler_stats.num_waiting_reqs,
                "kv_cache_usage": round(scheduler_stats.kv_cache_usage, 6),
                "num_preempted": iteration_stats.num_preempted_reqs if iteration_stats else 0,
                "num_prefill_tokens": details.num_ctx_tokens if details else 0,
                "num_decode_tokens": details.num_generation_tokens if details else 0,
                "elapsed_ms": details.elapsed_ms if details else None,
            })

        def log_engine_initialized(self):
            pass

    return StepLogger


class _Sink:
    def __init__(self):
        self.steps: list = []
        self.t0 = time.monotonic()
        self.core_ts = None
        self.core_stats = None


def _tap_core_timestamps(engine, sink) -> bool:
    """Keep each EngineCoreOutputs' timestamp (the engine core's monotonic clock, the same
    clock as time.monotonic() here) for the stat logger's record of the same outputs."""
    core = engine.engine_core
    original = core.get_output_async

    async def get_output_async():
        outputs = await original()
        sink.core_ts = getattr(outputs, "timestamp", None)
        sink.core_stats = getattr(outputs, "scheduler_stats", None)
        return outputs

    try:
        core.get_output_async = get_output_async
    except (AttributeError, TypeError):
        return False
    return True


class _Prompts:
    """Distinct random prompts: request k of the profile draws from a generator seeded by k."""

    def __init__(self, vocab: int, seed: int):
        import numpy as np
        self.np, self.vocab, self.seed, self.k = np, vocab, seed, 0

    def __call__(self, tokens: int) -> list:
        self.k += 1
        rng = self.np.random.default_rng([self.seed, 0x5354_4550, self.k])
        return rng.integers(0, self.vocab, size=int(tokens)).tolist()


def _params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                          temperature=1.0, detokenize=False, output_kind=RequestOutputKind.DELTA)


async def _submit(engine, prompt: list, max_tokens: int, rid: str, started=None):
    """Add one request (awaited: requests reach the engine in the order submitted) and return
    the task that drains its outputs (cancelled: vLLM aborts the request)."""
    q = await engine.add_request(rid, {"prompt_token_ids": prompt}, _params(max_tokens))

    async def drain():
        try:
            finished = False
            while not finished:
                out = q.get_nowait() or await q.get()
                finished = out.finished
                if started is not None and not started.is_set():
                    started.set()
        except asyncio.CancelledError:
            await engine.abort(q.request_id, internal=True)
            raise

    return asyncio.create_task(drain())


async def _serve_all(engine, prompts, reqs: list, name: str, offset: int = 0) -> None:
    tasks = [await _submit(engine, prompts(p), m, f"{name}-{offset + j}")
             for j, (p, m) in enumerate(reqs)]
    await asyncio.gather(*tasks)


async def _run_phase(engine, sink, spec: tuple, prompts: _Prompts, budget: int,
                     max_seqs: int, name: str) -> dict:
    await engine.reset_prefix_cache()
    sink.steps = []
    t0 = time.monotonic()
    sink.t0 = t0
    kind = spec[0]
    arrivals = None
    if kind == "mix":
        base_reqs, injected, gaps = mix_plan(spec[1], spec[2], spec[3], prompts.seed)
        reqs = list(base_reqs)
        events = [asyncio.Event() for _ in base_reqs]
        base = [await _submit(engine, prompts(p), m, f"{name}-{j}", events[j])
                for j, (p, m) in enumerate(base_reqs)]
        for e in events:
            await e.wait()
        arrivals, tasks = [], []
        for (size, m), gap in zip(injected, gaps):
            await asyncio.sleep(gap)
            started = asyncio.Event()
            reqs.append((size, m))
            arrivals.append(time.monotonic() - t0)
            tasks.append(await _submit(engine, prompts(size), m, f"{name}-{len(reqs) - 1}",
                                       started))
            await started.wait()
        await asyncio.gather(*tasks)
        for task in base:          # vLLM aborts them; the replay stops where the logs differ
            task.cancel()
        await asyncio.gather(*base, return_exceptions=True)
    elif kind in ("ladder", "burst"):
        reqs = (ladder_requests(spec[1], spec[2], budget, max_seqs=max_seqs)
                if kind == "ladder" else burst_requests(spec[1], spec[2]))
        await _serve_all(engine, prompts, reqs, name)
    else:
        batch = spec[1]
        reqs = [(INJECT_PROMPT_TOKENS, 10 ** 5)] * batch
        events = [asyncio.Event() for _ in range(batch)]
        base = [await _submit(engine, prompts(p), m, f"{name}-{j}", events[j])
                for j, (p, m) in enumerate(reqs)]
        for e in events:
            await e.wait()
        await asyncio.sleep(INJECT_GAP_S)
        for size in INJECT_SIZES:
            for _ in range(INJECT_REPEATS):
                reqs.append((size, 1))
                await _serve_all(engine, prompts, [(size, 1)], name, len(reqs) - 1)
                await asyncio.sleep(INJECT_GAP_S)
        for task in base:          # vLLM aborts them; the replay stops where the logs differ
            task.cancel()
        await asyncio.gather(*base, return_exceptions=True)
    wall = time.monotonic() - t0
    await asyncio.sleep(0.3)       # the last step's stats arrive after its outputs
    phase = {"name": name, "spec": list(spec), "requests": [list(r) for r in reqs],
             "steps": list(sink.steps), "wall_s": round(wall, 3)}
    if arrivals is not None:       # the injected requests' submission times, the steps' clock
        phase["arrivals_s"] = [round(a, 6) for a in arrivals]
    return phase


def _capture_sizes(engine) -> tuple:
    """(full-graph decode batch sizes, piecewise token sizes) of the built engine."""
    cfg = engine.vllm_config
    sizes = sorted(int(s) for s in (cfg.compilation_config.cudagraph_capture_sizes or []))
    full = [s for s in sizes if s <= int(cfg.scheduler_config.max_num_seqs)]
    return full, sizes


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(path)


async def _measure(scn, out: Path, budget_s: float, phases) -> dict:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from simkv.gpu.vllm.driver import _versions
    from simkv.gpu.vllm.engine_args import engine_kwargs, write_model_dir
    start = time.monotonic()
    sink, setup = _Sink(), {}
    raw = {"format": RAW_FORMAT, "meta": {}, "phases": []}
    with tempfile.TemporaryDirectory(prefix="simkv-vllm-") as tmp:
        kwargs = engine_kwargs(scn, write_model_dir(scn, tmp))
        logger = _logger_class()
        t0 = time.monotonic()
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs),
            stat_loggers=[lambda config, index=0: logger(config, index, sink)])
        setup["engine_build_s"] = round(time.monotonic() - t0, 2)
        try:
            setup["core_timestamps"] = _tap_core_timestamps(engine, sink)
            full, piecewise = _capture_sizes(engine)
            try:
                import torch
                props = torch.cuda.get_device_properties(0)
                sm_count, device_name = int(props.multi_processor_count), props.name
            except Exception:       # noqa: BLE001 - recorded as unknown
                sm_count = device_name = None
            kwargs["model"] = f"(a folder holding {scn.model.name}'s config.json)"
            raw["meta"] = {
                "scenario": str(scn.name), "model": scn.model.name, "gpu": scn.gpu.name,
                "versions": {**_versions(), "driver": DRIVER},
                "engine_kwargs": kwargs,
                "vllm_num_gpu_blocks": int(engine.vllm_config.cache_config.num_gpu_blocks),
                "full_graph_sizes": full, "piecewise_graph_sizes": piecewise,
                "async_scheduling": bool(getattr(engine.vllm_config.scheduler_config,
                                                 "async_scheduling", False)),
                "sm_count": sm_count, "device_name": device_name,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "command": " ".join(["python -m simkv.gpu.vllm.step_profile", *sys.argv[1:]]),
                "stage_steps": STAGE_STEPS, "setup": setup,
                "mix": {"sizes": list(MIX_SIZES), "repeats": MIX_REPEATS,
                        "gap_s": list(MIX_GAP_S), "spread": list(MIX_SPREAD)},
                "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
            }
            prompts = _Prompts(scn.model.vocab_size, int(scn.seed))
            t0 = time.monotonic()
            n, p, m = WARMUP
            await _serve_all(engine, prompts, [(p, m)] * n, "warmup")
            setup["warmup_s"] = round(time.monotonic() - t0, 2)
            budget = int(kwargs["max_num_batched_tokens"])
            max_seqs = int(kwargs["max_num_seqs"])
            seen: dict = {}
            for spec in phases:
                name = phase_name(spec)
                seen[name] = seen.get(name, 0) + 1
                name += f"-r{seen[name]}" if seen[name] > 1 else ""
                if time.monotonic() - start > budget_s:
                    raw["meta"]["cut_at"] = name
                    break
                try:
                    phase = await _run_phase(engine, sink, spec, prompts, budget, max_seqs,
                                             name)
                except Exception as e:      # noqa: BLE001 - recorded, the phases so far kept
                    raw["meta"]["error"] = f"{name}: {type(e).__name__}: {e}"
                    print(f"[step-profile] {raw['meta']['error']}", file=sys.stderr, flush=True)
                    break
                raw["phases"].append(phase)
                print(f"[step-profile] {phase['name']}: {len(phase['requests'])} requests, "
                      f"{len(phase['steps'])} steps in {phase['wall_s']:.1f} s "
                      f"(at {time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
                raw["meta"]["measure_s"] = round(time.monotonic() - start, 1)
                _write(out / "raw.json", raw)
        finally:
            engine.shutdown()
    raw["meta"]["measure_s"] = round(time.monotonic() - start, 1)
    _write(out / "raw.json", raw)
    return raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="on the GPU: serve the phases, write OUT/raw.json")
    m.add_argument("scenario")
    m.add_argument("--out", required=True)
    m.add_argument("--budget-s", type=float, default=400.0,
                   help="start no phase after this many seconds (the engine start counted)")
    m.add_argument("--phases", choices=sorted(PHASE_SETS), default="profile",
                   help="profile: the profile's phases; mix: prompts in decode streams as "
                        "a trace has them")
    b = sub.add_parser("build", help="on the CPU: raw.json[.gz] -> steps.csv and meta.json "
                                     "(several: their phases together, merge_raws)")
    b.add_argument("raw", nargs="+")
    b.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        from simkv.config.scenario import load_scenario
        scn = load_scenario(args.scenario)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        asyncio.run(_measure(scn, out, args.budget_s, PHASE_SETS[args.phases]))
        return 0
    raws = []
    for name in args.raw:
        path = Path(name)
        try:
            data = path.read_bytes()
            if path.suffix == ".gz":
                import gzip
                data = gzip.decompress(data)
            raws.append(json.loads(data))
        except (OSError, ValueError) as e:
            print(f"error: {name}: not a readable raw step-profile record ({e})",
                  file=sys.stderr)
            return 2
        if raws[-1].get("format") != RAW_FORMAT:
            print(f"error: {name}: format {raws[-1].get('format')!r}, expected {RAW_FORMAT}",
                  file=sys.stderr)
            return 2
    try:
        raw = raws[0] if len(raws) == 1 else merge_raws(raws, args.raw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = build_profile(raw, args.out, " ".join(args.raw))
    for p in meta["phases"]:
        print(f"{p['name']}: {p['steps_logged']} steps logged, {p['steps_replayed']} replayed, "
              f"{p['rows']} rows" + (f"; stopped: {p['stopped']}" if p["stopped"] else ""))
    print(f"{meta['rows']} rows -> {args.out}/steps.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
