"""Prefill/decode disaggregation: prompts computed on prefill replicas, their KV sent over a
link to decode replicas that generate the output.

The flow is vLLM's KV-connector flow as its disaggregated proxy drives it (vLLM docs,
features/disagg_prefill and nixl_connector_usage; llm-d's and Dynamo's P/D guides describe
the same hand-off):

1. a request arrives and the router picks a prefill replica (the policy over the prefill
   replicas); there it is served with one output token (the proxy sends it with
   max_tokens=1), so its prompt is computed and a token sampled that the client never sees;
2. the prefill replica keeps the prompt's blocks when the request finishes (vLLM's
   `request_finished` delays the free until the KV is read): `Scheduler.hold_finished_blocks`;
3. the router picks a decode replica (the policy over the decode replicas that can take blocks
   for the whole prompt, `Scheduler.receive_prompt`); when none can, the request waits on the
   prefill replica, first come first served, and is placed when a decode step ends
   (backpressure);
4. the KV moves: latency + the prompt's KV bytes (its blocks on the prefill replica) over the
   link (`kv_transfer_s` in requests.csv); then the prefill replica frees its blocks and the
   decode replica counts all prompt tokens but the last as computed (vLLM's
   `_update_waiting_for_remote_kv` does the same: the last token is computed again for its
   logits) and runs it from its next step (vLLM queues it again and admits it like any
   waiting request; admitting it at once keeps a pool from stalling with its blocks held
   by received requests queued behind a preempted one);
5. the decode replica's step that computes that last token emits the first output token.

TTFT is therefore client-side: arrival -> the first token of the decode replica (prefill
queueing and compute, waiting for room, the transfer, the decode replica's queue and its first
step). A replica whose pool is full of blocks held for transfers parks its waiting
queue (`Scheduler.park_waiting`) so that its loop idles rather than stops, and takes the queue
back when a transfer frees blocks. Under P/D, requests with n > 1 and cancellations are not
simulated (an error at the start of the run says so).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import pandas as pd

from simkv.engine.metrics import latency_family, requests_frame
from simkv.engine.request import Request
from simkv.errors import InputError


def _copy(req: Request, output_tokens: int) -> Request:
    """A fresh request like `req` (the trace's), with `output_tokens` to generate."""
    return Request(req.request_id, req.arrival_s, req.prompt_tokens, output_tokens, n=1,
                   prefix_ids=req.prefix_ids, prefix_block_tokens=req.prefix_block_tokens,
                   tenant=req.tenant, adapter=req.adapter, mm_key=req.mm_key,
                   priority=req.priority, parent_request_id=req.parent_request_id,
                   parent=req.parent, mm_spans=req.mm_spans)


class Disaggregation:
    """The hand-offs of one fleet run from its prefill replicas to its decode replicas."""

    def __init__(self, fleet):
        frame = fleet.frame
        where = fleet.scenario.path or fleet.scenario.name
        if len(frame) and (frame["n"] > 1).any():
            raise InputError(f"{where}: cluster: prefill/decode pools do not simulate requests "
                             "with n > 1 yet (the trace has some)")
        if len(frame) and frame["cancel_after_s"].notna().any():
            raise InputError(f"{where}: cluster: prefill/decode pools do not simulate "
                             "cancellations yet (the trace has cancel_after_s)")
        self.fleet = fleet
        self.env = fleet.env
        self.link = fleet.cluster.kv_transfer
        self.prefill = fleet.by_role["prefill"]
        self.decode = fleet.by_role["decode"]
        self.router_p = fleet.routers["prefill"]
        self.router_d = fleet.routers["decode"]
        self.originals: dict = {}
        self.pending: deque = deque()        # (request id, prefill replica, held since)
        self.handed: set = set()
        self.rows: dict = {}                 # request id -> {prefill, decode, transfer_s, wait_s}
        self.in_flight = 0
        for replica in self.prefill:
            replica.scheduler.hold_finished_blocks = True
            replica.parked = []
            replica.on_step = self._prefill_step
            replica.before_schedule = self._park_if_blocked
        for replica in self.decode:
            replica.parked = []
            replica.on_step = self._decode_step
            replica.before_schedule = self._park_if_blocked

    # -- 1. arrival -----------------------------------------------------------------------------
    def arrive(self, req: Request, now: float) -> None:
        self.originals[req.request_id] = req
        replica = self.prefill[self.router_p.choose(req)]
        self.rows[req.request_id] = {"prefill_replica": replica.name}
        sched = replica.scheduler
        sched.add_request(_copy(req, 1), now)
        if replica.parked and sched.waiting:       # behind the parked queue, in order
            replica.parked.extend(sched.park_waiting())
        replica.notify()

    def _park_if_blocked(self, replica) -> None:
        """Park a replica's queue when nothing runs, blocks are held for transfers (sent from a
        prefill replica, or arriving at a decode one) and the head's whole prompt does not
        fit in the free blocks: the loop idles until a transfer completes."""
        sched = replica.scheduler
        if not (sched.held or sched.receiving) or sched.running or sched.swapped or not sched.waiting \
                or sched.has_pending_events():
            return
        kv = sched.kv
        head = sched.waiting[0]
        need = -(-head.prompt_tokens // kv.block_size) + getattr(kv, "watermark_blocks", 0)
        if kv.num_free_blocks < need:
            replica.parked = sched.park_waiting() + replica.parked

    # -- 2-3. the prefill is done: find a decode replica ----------------------------------------
    def _prefill_step(self, replica, end_s: float) -> None:
        for rid in replica.scheduler.held:
            if rid not in self.handed:
                self.handed.add(rid)
                self.pending.append((rid, replica, end_s))
        self._place(end_s)

    def _decode_step(self, replica, end_s: float) -> None:
        if self.pending:
            self._place(end_s)

    def _place(self, now: float) -> None:
        while self.pending:
            rid, prefill, held_s = self.pending[0]
            original = self.originals[rid]
            half = _copy(original, original.output_tokens)
            fits = [i for i, d in enumerate(self.decode)
                    if d.scheduler.kv.blocks_needed(half.max_tokens) <=
                    d.scheduler.kv.max_admissible_blocks()
                    and half.max_tokens <= d.scheduler.max_model_len]
            if not fits:                     # no decode replica can ever serve it
                self.pending.popleft()
                self.rows[rid]["rejected"] = "no decode replica's pool can hold it"
                self._release(prefill, rid)
                continue
            candidates = list(fits)
            placed = None
            while candidates:
                pick = self.router_d.choose(half, candidates)
                if self.decode[pick].scheduler.receive_prompt(half, now):
                    placed = self.decode[pick]
                    break
                candidates.remove(pick)
            if placed is None:
                return                       # backpressure: wait for a decode step to end
            self.pending.popleft()
            bs = prefill.scenario.cache.block_size
            num_bytes = -(-original.prompt_tokens // bs) * prefill.sizing.bytes_per_block
            seconds = self.link.seconds(num_bytes)
            self.rows[rid].update(decode_replica=placed.name, kv_transfer_s=seconds,
                                  handoff_wait_s=now - held_s, kv_transfer_bytes=num_bytes)
            self.in_flight += 1
            ev = self.env.timeout(seconds)
            ev.callbacks.append(lambda _ev, p=prefill, d=placed, r=rid: self._received(p, d, r))

    # -- 4. the KV is there ----------------------------------------------------------------------
    def _received(self, prefill, decode, rid: int) -> None:
        self.in_flight -= 1
        self._release(prefill, rid)
        if decode.parked:
            decode.scheduler.unpark_waiting(decode.parked)
            decode.parked = []
        decode.scheduler.prompt_received(rid, self.env.now)
        decode.notify()

    def _release(self, prefill, rid: int) -> None:
        sched = prefill.scheduler
        sched.release_held(rid)
        if prefill.parked:
            sched.unpark_waiting(prefill.parked)
            prefill.parked = []
        prefill.notify()
        if self._prefill_final():
            for d in self.decode:
                d.notify()

    def _prefill_final(self) -> bool:
        return not self.pending and not self.in_flight and all(
            p.arrivals_done and not p.scheduler.has_unfinished() and not p.scheduler.held
            for p in self.prefill)

    def pending_for(self, replica) -> bool:
        """Whether a replica must keep waiting though it holds nothing: a decode replica while
        prefill replicas may still hand it requests."""
        return replica.pool.role == "decode" and not self._prefill_final()

    def cancel(self, request_id: int) -> bool:
        return False                          # no cancellations under P/D (checked at start)

    # -- results ---------------------------------------------------------------------------------
    def requests_frame(self, per_replica: list) -> pd.DataFrame:
        """One row per request: the decode half's times (client-side TTFT), the prefill half's
        cache hits and queueing, both halves' preemptions and recomputed tokens, and where it
        went (`replica`: its decode replica)."""
        prefill_rows, decode_rows = [], []
        for replica, _, df in per_replica:
            (prefill_rows if replica.pool.role == "prefill" else decode_rows).append(df)
        pre = pd.concat(prefill_rows, ignore_index=True).set_index("request_id")
        dec = pd.concat(decode_rows, ignore_index=True).set_index("request_id") \
            if decode_rows else pre.iloc[:0]
        out = pre.copy()
        out["output_tokens"] = [self.originals[i].output_tokens for i in out.index]
        for col in ("first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s"):
            out[col] = np.nan
        both = out.index.intersection(dec.index)
        for col in ("first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s", "status"):
            out.loc[both, col] = dec.loc[both, col]
        out.loc[both, "preemptions"] += dec.loc[both, "preemptions"]
        out.loc[both, "recomputed_tokens"] += dec.loc[both, "recomputed_tokens"]
        missing = out.index.difference(dec.index)
        out.loc[missing[out.loc[missing, "status"] == "completed"], "status"] = "rejected"
        rows = self.rows
        out["replica"] = [rows.get(i, {}).get("decode_replica", "") for i in out.index]
        out["prefill_replica"] = [rows.get(i, {}).get("prefill_replica", "") for i in out.index]
        out["decode_replica"] = out["replica"]
        out["kv_transfer_s"] = [rows.get(i, {}).get("kv_transfer_s", math.nan)
                                for i in out.index]
        out = out.reset_index()
        columns = [c for c in out.columns if c != "queue_s"] + ["queue_s"]
        for col in ("preemptions", "recomputed_tokens", "output_tokens"):
            out[col] = out[col].astype(np.int64)
        return out[columns].sort_values("request_id", kind="stable").reset_index(drop=True)

    def summary(self, requests: pd.DataFrame) -> dict:
        rows = [r for r in self.rows.values() if "kv_transfer_s" in r]
        return {
            "link": self.link.name,
            "bandwidth_bytes_per_s": self.link.bandwidth_bytes_per_s,
            "latency_s": self.link.latency_s,
            "transfers": len(rows),
            "bytes_total": int(sum(r["kv_transfer_bytes"] for r in rows)),
            "kv_transfer_s": latency_family([r["kv_transfer_s"] for r in rows]),
            "handoff_wait_s": latency_family([r["handoff_wait_s"] for r in rows]),
        }
