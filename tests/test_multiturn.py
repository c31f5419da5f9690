"""Turns: a prompt that continues an earlier request hits that request's prompt and output blocks.

vLLM v0.26 hashes a full block from its tokens whether they are prompt or sampled tokens:
vllm/v1/request.py, Request.append_output_token_ids calls update_block_hashes, whose hasher
(vllm/v1/core/kv_cache_utils.py, get_request_block_hasher -> request_block_hasher) chains
hash_block_tokens over `all_token_ids`; BlockPool.cache_full_blocks indexes each block once it
is full and computed (vllm/v1/core/block_pool.py). The next turn of a chat, whose prompt holds
the previous answer, finds those blocks in KVCacheManager.get_computed_blocks
(vllm/v1/core/kv_cache_manager.py) up to `num_tokens - 1`. The simulator has no token ids, so
a trace says which request a prompt continues (`parent_request_id`), and a block that lies
wholly inside the parent's prompt + output takes the parent's block's identity.

Block size 16 throughout. The pair in most tests: P, a 40-token prompt with a 30-token output
(70 tokens: blocks 0..3 lie inside them, block 4 (tokens 64..79) runs past them), and C, which
continues P with 20 new tokens (a 90-token prompt).
"""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import simkv
import simkv.engine.decode_run as decode_run_module
from simkv.cli import run_cli
from simkv.engine.kv.hashing import extend_block_hashes, hash_root
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.request import Request, Sequence
from simkv.errors import InputError
from simkv.sim.engine import Simulation
from simkv.workload.frames import requests_from_frame
from simkv.workload.synthetic import generate_synthetic
from simkv.workload.traces import load_trace, trace_stats, write_canonical
from tests.test_decode_run import assert_identical, outputs
from tests.test_kv_manager import admit, append, finish_prompt

BS = 16


def request(rid, prompt, output, parent=None, tenant="", adapter="", n=1, ids=None):
    req = Request(rid, 0.0, prompt, output, n=n, tenant=tenant, adapter=adapter,
                  prefix_ids=tuple(ids) if ids else None, prefix_block_tokens=BS if ids else 0,
                  parent=parent, parent_request_id=-1 if parent is None else parent.request_id)
    req.hash_root = hash_root(req, False)
    return req


def hashes(req, blocks, sample=0, seq_id=None):
    """The chained hashes of the first `blocks` full blocks of sample `sample` of `req`."""
    seq = Sequence(req.request_id if seq_id is None else seq_id, req, sample,
                   req.prompt_tokens + req.output_tokens)
    return extend_block_hashes(seq, blocks, BS)


def pair(**child):
    parent = request(0, 40, 30)
    return parent, request(1, 90, 8, parent=parent, **child)


def seq_of(req):
    seq = Sequence(req.request_id, req, 0, req.prompt_tokens)
    req.seqs.append(seq)
    req.all_seqs.append(seq)
    return seq


def serve_until(kv, seq, computed):
    """Prefill the prompt, then decode until `computed` tokens are computed."""
    if seq.num_computed_tokens == 0:
        admit(kv, seq)
        finish_prompt(seq)
    while seq.num_computed_tokens < computed:
        assert append(kv, seq)


# --- identities --------------------------------------------------------------------------------

def test_a_turns_blocks_inside_the_parents_prompt_and_output_are_the_parents():
    parent, child = pair()
    ours, theirs = hashes(child, 5), hashes(parent, 5)
    assert ours[:4] == theirs[:4]         # blocks 0-1: P's prompt; 2-3: P's sampled tokens
    assert ours[4] != theirs[4]           # tokens 64..79: P's last 6, then C's own


def test_a_turn_continues_only_its_parents_first_sample():
    """n > 1 parents: the trace's prompt holds one answer, taken as sample 0's."""
    parent = request(0, 40, 30, n=2)
    child = request(1, 90, 8, parent=parent)
    ours = hashes(child, 4)
    assert ours == hashes(parent, 4, sample=0)
    assert ours[2:] != hashes(parent, 4, sample=1)[2:]   # sample 1's own outputs
    assert ours[:2] == hashes(parent, 2, sample=1)       # the prompt they all share


def test_turns_chain_back_through_every_earlier_turn():
    """G (20 + 12 tokens), P continuing G (48 + 16), C continuing P (80): C's blocks 0-1 are
    G's, 2-3 are P's own (P's new prompt tokens, then its output), 4 is C's."""
    g = request(0, 20, 12)
    p = request(1, 48, 16, parent=g)
    c = request(2, 80, 4, parent=p)
    ours = hashes(c, 5)
    assert ours[:2] == hashes(g, 2)
    assert ours[:4] == hashes(p, 4)
    assert ours[4] not in hashes(p, 5)


def test_sibling_turns_share_their_parent_and_nothing_after_it():
    parent, first = pair()
    second = request(2, 100, 8, parent=parent)
    a, b = hashes(first, 5), hashes(second, 6)
    assert a[:4] == b[:4] and a[4] != b[4]


@pytest.mark.parametrize("child", [{"tenant": "other"}, {"adapter": "lora-x"}])
def test_a_turn_under_another_tenant_or_adapter_shares_nothing(child):
    parent, other = pair(**child)
    assert not set(hashes(other, 5)) & set(hashes(parent, 5))


def test_a_parents_trace_ids_carry_into_its_turns():
    """P's prompt blocks keyed by trace ids: a third request with the same ids shares them
    with P's turn as with P."""
    parent = request(0, 40, 30, ids=(7, 8, 9))
    child = request(1, 90, 8, parent=parent)
    stranger = request(2, 40, 8, ids=(7, 8, 9))
    assert hashes(child, 2) == hashes(stranger, 2) == hashes(parent, 2)


# --- what the index holds when the turn looks ------------------------------------------------

def test_a_turn_arriving_after_its_parent_finished_hits_four_blocks():
    """P computes 69 tokens (its last sampled token never is): blocks 0..3 are indexed; C's
    lookup hits them, 64 tokens, and computes the other 26."""
    parent, child = pair()
    kv = PagedKVCacheManager(16, BS)
    p = seq_of(parent)
    serve_until(kv, p, 69)
    kv.free(p)
    assert kv.prefix_lookup(seq_of(child)) == ([0, 1, 2, 3], 64)


def test_a_turn_arriving_while_its_parent_decodes_hits_only_the_computed_blocks():
    """After 50 tokens P has blocks 0..2 full (48 tokens); block 3 fills at 64. The same
    lookup asked again (the head of the queue while memory is full) sees it."""
    parent, child = pair()
    kv = PagedKVCacheManager(16, BS)
    p, c = seq_of(parent), seq_of(child)
    serve_until(kv, p, 50)
    assert kv.prefix_lookup(c) == ([0, 1, 2], 48)
    serve_until(kv, p, 63)
    assert kv.prefix_lookup(c) == ([0, 1, 2], 48)
    serve_until(kv, p, 64)
    assert kv.prefix_lookup(c) == ([0, 1, 2, 3], 64)


def test_a_turns_identity_comes_from_the_trace_not_from_the_served_parent():
    """requests_from_frame gives a turn its parent as the trace row, not the request the
    scheduler serves, whose counts change (a fanned-out request's output becomes its samples'
    sum, a capped one shrinks): the turn's hashes stay what they were."""
    frame = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 1.0],
                          "prompt_tokens": [40, 90], "output_tokens": [30, 8],
                          "prefix_ids": [None, None], "prefix_block_tokens": [0, 0],
                          "tenant": ["", ""], "adapter": ["", ""], "n": [2, 1],
                          "cancel_after_s": [math.nan, math.nan],
                          "parent_request_id": [-1, 0]})
    served, child = requests_from_frame(frame)
    assert child.parent is not served and child.parent.request_id == 0
    child.hash_root = served.hash_root = hash_root(child, False)
    before = hashes(child, 5)
    served.output_tokens = 60
    assert hashes(child, 5) == before == hashes(request(1, 90, 8, parent=request(0, 40, 30)), 5)


# --- simulated end to end --------------------------------------------------------------------

TRACE = ("request_id,arrival_s,prompt_tokens,output_tokens,parent_request_id\n"
         "p,0.0,40,30,\n"
         "c,10.0,90,8,p\n")


def scenario(trace, **changes):
    raw = {"name": "turns", "model": "llama-3.1-8b", "gpu": "h200", "cost_model": "auto",
           "seed": 0, "semantics": "vllm-0.18",
           "cache": {"block_size": BS, "gpu_memory_utilization": 0.9},
           "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 2048},
           "workload": {"trace": str(trace)}}
    for key, value in changes.items():
        if "." not in key:
            raw[key] = value
            continue
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return simkv.load_scenario(raw)


def cached_tokens(trace_path) -> list:
    return Simulation(scenario(trace_path)).run().requests["cached_tokens"].tolist()


def test_a_simulated_turn_prefills_only_what_its_parent_did_not_leave(tmp_path):
    turns = tmp_path / "turns.csv"
    turns.write_text(TRACE)
    plain = tmp_path / "plain.csv"
    plain.write_text(TRACE.replace(",p\n", ",\n"))
    assert cached_tokens(turns) == [0, 64]
    assert cached_tokens(plain) == [0, 0]


@pytest.mark.parametrize("semantics", ["vllm-0.26", "vllm-0.18"])
def test_a_simulated_turn_of_a_two_sample_parent_hits_sample_0s_answer(tmp_path, semantics):
    """Fanned out (vllm-0.26: child request 0) or forked (vllm-0.18: the first sequence), the
    parent's sample 0 leaves blocks 0..3. (A fanned-out parent's row counts both samples'
    outputs, 60: the turn's identities come from the trace row, not from that count.)"""
    path = tmp_path / "n2.csv"
    path.write_text(TRACE.replace("request_id,", "n,request_id,").replace("\np,", "\n2,p,")
                    .replace("\nc,", "\n1,c,"))
    requests = Simulation(scenario(path, **{"semantics": semantics})).run().requests
    assert requests["cached_tokens"].tolist()[1] == 64
    assert requests["output_tokens"].tolist() == [60 if semantics == "vllm-0.26" else 30, 8]


# --- the canonical CSV columns ---------------------------------------------------------------

def write(tmp_path, text, name="t.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_parent_ids_name_the_0_based_row_without_a_request_id_column(tmp_path):
    """Rows are renumbered by arrival; a parent is named in the frame by its new id."""
    df = load_trace(write(tmp_path, "arrival_s,prompt_tokens,output_tokens,parent_request_id\n"
                                    "5.0,100,10,1\n"       # row 0 continues row 1
                                    "1.0,50,20,\n"         # row 1
                                    "9.0,150,5,0\n"))      # row 2 continues row 0
    assert df["prompt_tokens"].tolist() == [50, 100, 150]
    assert df["parent_request_id"].tolist() == [-1, 0, 1]


def test_request_ids_may_be_any_text(tmp_path):
    df = load_trace(write(tmp_path, "request_id,arrival_s,prompt_tokens,output_tokens,"
                                    "parent_request_id\n"
                                    "chat-7/turn-1,0,10,5,-1\n"
                                    "chat-7/turn-2,1,20,5,chat-7/turn-1\n"))
    assert df["request_id"].tolist() == [0, 1] and df["parent_request_id"].tolist() == [-1, 0]


def test_turns_round_trip_through_the_canonical_csv_and_show_in_the_stats(tmp_path):
    original = load_trace(write(tmp_path, TRACE))
    text = write_canonical(original, tmp_path / "out.csv").read_text().splitlines()
    assert text[0].startswith("request_id,") and text[0].endswith(",parent_request_id")
    assert text[2].startswith("1,") and text[2].endswith(",0")
    pd.testing.assert_frame_equal(load_trace(tmp_path / "out.csv"), original)
    assert trace_stats(original)["turn_fraction"] == 0.5


HEADER = "request_id,arrival_s,prompt_tokens,output_tokens,parent_request_id\n"


@pytest.mark.parametrize("rows,expected", [
    ("a,0,10,5,\nb,1,20,5,z\n", "line 3: parent_request_id 'z' names no request"),
    ("a,0,10,5,\nb,1,20,5,b\n", "line 3: parent_request_id 'b' is the request itself"),
    ("a,2,10,5,\nb,1,20,5,a\n", "line 3: parent_request_id 'a' (line 2) arrives after this"),
    ("a,1,20,5,b\nb,1,10,5,\n", "line 2: parent_request_id 'b' (line 3) arrives at the same "
                                "time as, and below,"),
    ("a,1,20,5,b\nb,1,10,5,a\n", "closes a cycle of parents (lines 2 -> 3 -> 2)"),
    ("a,0,10,5,\nb,1,14,5,a\n", "line 3: parent_request_id 'a' (line 2): prompt_tokens 14 is "
                                "shorter than the parent's prompt 10 + output 5 = 15"),
    ("a,0,10,5,\na,1,20,5,a\n", "line 3: request_id 'a' repeats line 2"),
    (",0,10,5,\nb,1,20,5,\n", "line 2: request_id is empty"),
])
def test_a_bad_turn_is_an_error_naming_its_line(tmp_path, rows, expected):
    path = write(tmp_path, HEADER + rows)
    with pytest.raises(InputError) as error:
        load_trace(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message


def test_trace_commands_read_and_write_the_turn_columns(tmp_path, capsys):
    path = write(tmp_path, TRACE)
    assert run_cli(["trace", "stats", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turn_fraction"] == 0.5
    assert run_cli(["trace", "convert", str(path), str(tmp_path / "out.csv")]) == 0
    assert load_trace(tmp_path / "out.csv")["parent_request_id"].tolist() == [-1, 0]
    bad = write(tmp_path, HEADER + "a,0,10,5,x\n", "bad.csv")
    assert run_cli(["trace", "stats", str(bad)]) == 2
    assert "parent_request_id 'x' names no request" in capsys.readouterr().err


# --- the conversation generator --------------------------------------------------------------

CHAT = {"num_requests": 40, "arrival": {"process": "poisson", "rate": 2},
        "prompt_tokens": {"dist": "uniform", "min": 50, "max": 400},
        "output_tokens": {"dist": "uniform", "min": 20, "max": 200},
        "conversation": {"turns": {"dist": "uniform", "min": 1, "max": 5},
                         "think_time_s": {"dist": "exponential", "mean": 20},
                         "new_tokens": {"dist": "uniform", "min": 10, "max": 100}}}


def test_each_turn_continues_the_one_before():
    df = generate_synthetic(CHAT, seed=0)
    parents = df["parent_request_id"].to_numpy()
    later = np.flatnonzero(parents >= 0)
    assert len(df) > 40 and len(later) == len(df) - 40
    p = parents[later]
    prompt, output, arrival = (df[c].to_numpy() for c in
                               ("prompt_tokens", "output_tokens", "arrival_s"))
    new = prompt[later] - prompt[p] - output[p]
    assert new.min() >= 10 and new.max() <= 100
    assert (arrival[later] >= arrival[p]).all() and (p < later).all()
    assert df["arrival_s"].is_monotonic_increasing and df.attrs["warnings"] == []


def test_conversations_start_where_the_spec_without_them_starts_its_requests():
    plain = {k: v for k, v in CHAT.items() if k != "conversation"}
    first = generate_synthetic(CHAT, seed=3).query("parent_request_id < 0")
    alone = generate_synthetic(plain, seed=3)
    assert first["arrival_s"].tolist() == alone["arrival_s"].tolist()
    assert first["prompt_tokens"].tolist() == alone["prompt_tokens"].tolist()


def test_a_turn_keeps_its_conversations_tenant_and_system_prompt():
    spec = {**CHAT, "tenants": 3,
            "shared_prefix": {"num_groups": 2, "prefix_tokens": 64, "fraction": 1.0}}
    df = generate_synthetic(spec, seed=1)
    for child, parent in zip(df.index, df["parent_request_id"]):
        if parent >= 0:
            assert df["tenant"][child] == df["tenant"][parent]
            assert df["prefix_ids"][child] is None and df["prefix_block_tokens"][child] == 0
        else:
            assert df["prefix_ids"][child] is not None


@pytest.mark.parametrize("conversation,expected", [
    ({"turns": 2, "new_tokens": 5}, "conversation.think_time_s is required"),
    ({"turns": 2, "new_tokens": 5, "think_time_s": -1}, "think_time_s: -1 is not in"),
    ({"turns": 2, "new_tokens": 5, "think_time_s": {"dist": "gamma"}},
     "think_time_s.dist must be one of fixed, uniform, exponential, lognormal"),
    ({"turns": 0, "new_tokens": 5, "think_time_s": 1}, "conversation.turns: 0 is not in"),
    ({"turns": 2, "new_tokens": 5, "think_time_s": 1, "users": 3}, "conversation.users: unknown"),
    (3, "conversation must be a mapping"),
])
def test_a_bad_conversation_spec_names_its_key(conversation, expected):
    with pytest.raises(InputError, match=expected.replace(".", r"\.")):
        generate_synthetic({**CHAT, "conversation": conversation}, seed=0)


def test_a_chat_workload_with_turns_prefills_fewer_tokens_than_its_prompts():
    """The same requests, with and without saying which turn each continues."""
    raw = {"name": "chat", "model": "llama-3.1-8b", "gpu": "h200", "cost_model": "auto",
           "seed": 0, "semantics": "vllm-0.18", "cache": {"block_size": BS},
           "workload": {"synthetic": CHAT}}
    scn = simkv.load_scenario(raw)
    frame = generate_synthetic(CHAT, seed=0)
    with_turns = Simulation(scn, frame).run()
    without = Simulation(scn, frame.assign(parent_request_id=-1)).run()
    prefilled = [r.steps["num_prefill_tokens"].sum() for r in (with_turns, without)]
    assert prefilled[1] == frame["prompt_tokens"].sum()
    assert prefilled[0] < 0.7 * prefilled[1]
    assert with_turns.summary["prefix_cache_hit_ratio"] > 0.3


# --- decode runs -----------------------------------------------------------------------------

def guard_frame() -> pd.DataFrame:
    """P (32 + 200 tokens) from 0 s; at 0.3 s its turn C, 272 tokens (17 blocks) and one
    output token, on a pool of 17 blocks: C needs 17 - h blocks where P has h full ones, and
    P holds h + 1 (its partial tail), so C fits exactly in the step where P fills a block."""
    return pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.3],
                         "prompt_tokens": [32, 272], "output_tokens": [200, 1],
                         "prefix_ids": [None, None], "prefix_block_tokens": [0, 0],
                         "tenant": ["", ""], "adapter": ["", ""], "n": [1, 1],
                         "cancel_after_s": [math.nan, math.nan], "parent_request_id": [-1, 0]})


def guard_scenario():
    return simkv.load_scenario({
        "name": "turn-guard", "model": "llama-3.1-8b", "gpu": "h200", "cost_model": "auto",
        "seed": 0, "semantics": "vllm-0.18",
        "cache": {"block_size": BS, "num_gpu_blocks_override": 17},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_model_len": 272},
        "workload": {"synthetic": {"num_requests": 1, "arrival": {"process": "fixed", "rate": 1},
                                   "prompt_tokens": 1, "output_tokens": 1}}})


def test_no_decode_run_while_a_later_turn_waits_on_a_live_one(monkeypatch):
    """A decode run assumes what waits keeps waiting; a turn waiting for blocks while its
    parent decodes gains a hit each time the parent fills a block, and may fit in the step
    after. With the guard the runs give the step-by-step bytes; without it they do not (the
    turn is admitted later)."""
    scn = guard_scenario()
    assert_identical(scn, guard_frame())
    exact = Simulation(scn, guard_frame(), exact=True).run().requests
    assert exact["cached_tokens"].tolist() == [0, 96]    # admitted when P filled its 6th block
    monkeypatch.setattr(decode_run_module, "_waits_on_a_live_turn", lambda scheduler: False)
    assert outputs(scn, True, guard_frame()) != outputs(scn, False, guard_frame())
