"""Cost models of one step of a tensor-parallel replica: one rank's work plus its collectives.

Every rank runs the same step on its shards (simkv.parallel), so a step takes one rank's time:
its GEMMs over its share of the weights, its attention over its KV heads, and the collectives
that join the ranks (simkv.costmodel.allreduce), the term `allreduce`. With tensor_parallel_size
1 neither class below is used: a one-GPU replica's cost path has no collective term at all.

- Roofline: the roofline terms (simkv.costmodel.roofline) of one rank's weight bytes, FLOPs per
  token (its column and row shards; replicated norms and routers whole), LM-head rows, attention
  heads and KV bytes per token, plus `allreduce`.
- Profiled: a profile measured on the replica's rank 0 (`profiles/<gpu>/<model>-tp<N>/`), whose
  step times hold the collectives. Its fitted linear term holds them with the GEMMs, so the
  model takes out of `linear` what the profile's measured all-reduces (allreduce.csv) take for
  the step's rows and reports it as `allreduce`: the step's total is the fit's, and `explain`
  shows the collectives' share. The clock effect (simkv.costmodel.clock) scales the forward
  terms only, so it leaves the collectives' share alone (NVLink time, not SM time).
"""
from __future__ import annotations

from dataclasses import replace

from simkv import parallel
from simkv.costmodel.allreduce import StepCollectives
from simkv.costmodel.profiled import AROUND_TERMS, FORWARD_TERMS, ProfiledCostModel
from simkv.costmodel.roofline import RooflineCostModel


class TensorParallelRoofline(RooflineCostModel):
    """The roofline model of one rank of `tensor_parallel_size`, with an `allreduce` term."""

    def __init__(self, model, gpu, kv_dtype: str, block_size: int, params,
                 tensor_parallel_size: int, collectives: StepCollectives):
        super().__init__(model, gpu, kv_dtype, block_size, params)
        tp = self.tensor_parallel_size = tensor_parallel_size
        self.collectives = collectives
        self.term_names = self.term_names + ("allreduce",)
        self.name = f"roofline (tensor parallel {tp})"
        self.kv_bytes_per_token = parallel.kv_bytes_per_token(model, kv_dtype, tp)
        self.bytes_per_block = self.kv_bytes_per_token * block_size
        params = parallel.rank_params_by_part(model, tp)
        weight_bytes = parallel.rank_bytes_by_part(model, tp)
        self.weight_bytes = sum(v for part, v in weight_bytes.items()
                                if not (self.is_moe and part == "expert"))
        self.flops_per_token = 2.0 * sum(v for part, v in params.items()
                                         if part not in ("embedding", "lm_head", "expert"))
        self.flops_per_sample = 2.0 * parallel.padded_vocab_rows(model.vocab_size, tp) \
            * model.hidden_size
        self.attn_flops_per_pair /= tp                       # the rank's heads
        if self.is_moe:         # each expert's width is split: the rank's share of each
            self._expert_bytes_share = weight_bytes["expert"] / model.routed_expert_bytes()
            self._expert_flops_share = params["expert"] / model.params_by_part()["expert"]

    def term_values(self, plan) -> tuple:
        tokens = plan.num_prefill_tokens + plan.num_decode_tokens
        comm = self.collectives.seconds(tokens, plan.num_decode_tokens + plan.num_prefill_seqs) \
            if tokens else 0.0
        return super().term_values(plan) + (comm,)

    def moe(self, plan):
        m = super().moe(plan)
        return replace(m, expert_bytes_read=m.expert_bytes_read * self._expert_bytes_share,
                       active_expert_bytes=m.active_expert_bytes * self._expert_bytes_share,
                       expert_flops=m.expert_flops * self._expert_flops_share)

    def describe(self) -> dict:
        return {**super().describe(), "tensor_parallel_size": self.tensor_parallel_size,
                "allreduce": self.collectives.describe()}


class TensorParallelProfiled(ProfiledCostModel):
    """A profile of the replica's rank 0; `allreduce` is the measured collectives' share of the
    fitted step (taken out of `linear`)."""

    term_names = FORWARD_TERMS + AROUND_TERMS + ("allreduce",)

    def __init__(self, fit: dict, path, block_size: int, kv_dtype: str, model, gpu, scheduler,
                 tensor_parallel_size: int, collectives: StepCollectives):
        super().__init__(fit, path, block_size, kv_dtype, model, gpu, scheduler)
        tp = self.tensor_parallel_size = tensor_parallel_size
        self.collectives = collectives
        self.name = f"profile:{fit['gpu']}/{self.path.parent.name}"
        self.bytes_per_block = parallel.kv_bytes_per_token(model, kv_dtype, tp) * block_size
        # the decode and prefill kernels of a rank run its heads (the fit records the model's)
        self.layout = replace(self.layout,
                              num_kv_heads=parallel.kv_heads_per_rank(model, tp),
                              num_heads=model.num_heads // tp)

    def _comm(self, plan) -> float:
        tokens = plan.num_prefill_tokens + plan.num_decode_tokens
        if not tokens:
            return 0.0
        layout = self.layout
        if plan.num_prefill_tokens:
            rows = layout.mixed_size(tokens) or tokens
        else:
            rows = self._graph_rows[tokens] if tokens <= self._max_graph else tokens
        return self.collectives.seconds(rows, plan.num_decode_tokens + plan.num_prefill_seqs)

    def forward_values(self, plan) -> tuple:
        values = super().forward_values(plan)
        comm = self._comm(plan)
        return (values[0] - comm,) + values[1:] if comm else values

    def around_values(self, plan) -> tuple:
        return super().around_values(plan) + (self._comm(plan),)

    def decode_run_split(self, run, shared):
        return None          # decode runs step by step through decode_run_values

    def decode_run_values(self, run, shared):
        comm = self._comm(run.plan)      # every step of a run has the same rows
        for forward, around in super().decode_run_values(run, shared):   # around has it
            yield (forward[0] - comm,) + forward[1:], around

    def describe(self) -> dict:
        return {**super().describe(), "tensor_parallel_size": self.tensor_parallel_size,
                "allreduce": self.collectives.describe()}


def load_profiled(path, scenario) -> TensorParallelProfiled:
    """The profiled model of a TP profile's fit.json (`path`) for `scenario`, with the
    all-reduces its profile measured (allreduce.csv beside the fit) or, without them, the link's."""
    from pathlib import Path

    from simkv.costmodel.allreduce import ALLREDUCE_FILE, link_allreduce, read_measured
    from simkv.errors import read_json_object
    path = Path(path)
    if path.is_dir():
        path = path / "fit.json"
    tp = scenario.tensor_parallel_size
    fit = read_json_object(path, "a fit file: run `simkv fit` on a profile directory")
    measured_tp = fit.get("tensor_parallel_size")
    if measured_tp is None and (path.parent / "meta.json").is_file():   # the profiler's record
        measured_tp = read_json_object(path.parent / "meta.json", "a profile's meta.json") \
            .get("tensor_parallel_size")
    measured_tp = 1 if measured_tp is None else measured_tp
    if measured_tp != tp:
        from simkv.errors import InputError
        raise InputError(f"{path}: profiled at tensor_parallel_size {measured_tp}, the scenario "
                         f"has {tp} (profile it at {tp}, or use cost_model: roofline)")
    allreduce = read_measured(path.parent / ALLREDUCE_FILE, tp) or link_allreduce(tp)
    cache = scenario.cache
    return TensorParallelProfiled(fit, path, cache.block_size, cache.kv_dtype, scenario.model,
                                  scenario.gpu, scenario.scheduler, tp,
                                  StepCollectives(scenario.model, allreduce))


def roofline(scenario, params) -> TensorParallelRoofline:
    """The roofline model of one rank of the scenario's replica (link figures)."""
    from simkv.costmodel.allreduce import link_allreduce
    tp = scenario.tensor_parallel_size
    return TensorParallelRoofline(scenario.model, scenario.gpu, scenario.cache.kv_dtype,
                                  scenario.cache.block_size, params, tp,
                                  StepCollectives(scenario.model, link_allreduce(tp)))
