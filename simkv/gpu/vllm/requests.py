"""The scenario's requests as vLLM sees them: prompt token ids and sampling settings.

Prompt token ids are the ones simkv's own engine serves (`simkv.gpu.tokens`: a trace's prefix
identities become equal token blocks, so vLLM's prefix cache hits where the simulator's does).
Every request decodes exactly its trace's output length: `ignore_eos` with
`max_tokens == min_tokens == output_tokens`, whatever the random weights sample.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from simkv.errors import InputError
from simkv.gpu.tokens import prompt_token_ids
from simkv.workload.frames import requests_from_frame


@dataclass(frozen=True)
class VllmRequest:
    """One request of a pass: when it arrives (s from the pass's start), what it sends."""

    request_id: int
    arrival_s: float
    prompt_token_ids: tuple
    output_tokens: int           # tokens each sample decodes
    n: int = 1                   # samples (vLLM's `n`: the prompt once, n decodes)
    cancel_after_s: float = math.nan   # the client gives up this long after arrival (nan: never)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def vllm_id(self, pass_name: str) -> str:
        """vLLM's request id: unique across the passes one engine serves."""
        return f"{pass_name}-{self.request_id}"


def vllm_requests(frame, vocab_size: int, seed: int = 0, *, at_zero: bool = False) -> list:
    """VllmRequests of a canonical requests frame, in arrival order (request id breaks ties).

    `at_zero`: every arrival at 0 (the saturated pass). Raises InputError for a request vLLM
    cannot serve as asked (no prompt, no output token) and for what the prompt token ids cannot
    say: a turn that continues an earlier request (its prompt holds that request's answer,
    known only once it is generated) and multimodal spans.
    """
    out = []
    for req in requests_from_frame(frame):
        if req.parent_request_id >= 0:
            raise InputError(f"request {req.request_id} continues request "
                             f"{req.parent_request_id} (parent_request_id): turns are simulated "
                             "only")
        if req.mm_spans:
            raise InputError(f"request {req.request_id} has multimodal spans (mm_spans): a "
                             "text-only engine cannot serve them")
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise InputError(f"request {req.request_id}: vLLM needs at least one prompt and one "
                             f"output token (has {req.prompt_tokens} and {req.output_tokens})")
        out.append(VllmRequest(
            request_id=req.request_id, arrival_s=0.0 if at_zero else float(req.arrival_s),
            prompt_token_ids=tuple(prompt_token_ids(req, vocab_size, seed)),
            output_tokens=int(req.output_tokens), n=int(req.n),
            cancel_after_s=float(req.cancel_after_s)))
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def sampling_kwargs(request: VllmRequest) -> dict:
    """Keyword arguments of vLLM's SamplingParams for the request: exactly `output_tokens`
    tokens per sample, no detokenizing (the engine has no tokenizer). No per-request seed: vLLM
    samples seeded requests one by one, which would add host time a deployment doesn't have."""
    return {"n": request.n, "max_tokens": request.output_tokens,
            "min_tokens": request.output_tokens, "ignore_eos": True, "temperature": 1.0,
            "detokenize": False}


def with_output_cap(requests: list, max_output_tokens: int) -> list:
    """The requests with each output cut to `max_output_tokens` (the short warm-up pass)."""
    from dataclasses import replace
    return [replace(r, output_tokens=min(r.output_tokens, max_output_tokens)) for r in requests]
