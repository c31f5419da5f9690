"""Blocks that several running sequences hold: counted by the KV manager, carried by the plan,
and read again from L2 in the profiled model."""
import json
from pathlib import Path

import pytest

from simkv.costmodel.features import shared_read_tokens
from simkv.costmodel.profiled import ProfiledCostModel
from simkv.costmodel.shared_reads import (SHARED_READS_FILE, first_repeat_tokens,
                                          load_shared_reads, repeated_tokens)
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.errors import InputError
from tests.test_kv_manager import BS, admit, finish_prompt, fork, make_request, make_seq
from tests.test_profiled_costmodel import plan_of, write_fit
from tests.test_scheduler import make_scheduler, step
from tests.test_scheduler import make_request as scheduler_request

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiles" / "h200" / "llama-3.1-8b"


def forked_three_times():
    """A KV manager holding a 40-token prompt's 3 blocks in a parent and two forks of it."""
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(make_request(1, 40, n=3))
    admit(kv, parent)
    finish_prompt(parent)
    return kv, parent, [fork(kv, parent, 10), fork(kv, parent, 11)]


def test_a_fork_repeats_every_block_of_the_parent_and_freeing_it_repeats_none():
    kv, parent, children = forked_three_times()
    assert kv.num_shared_block_refs == 2 * 3            # 3 blocks, two more tables each
    kv.free(children[0])
    assert kv.num_shared_block_refs == 3
    kv.free(children[1])
    assert kv.num_shared_block_refs == 0
    kv.check_integrity()


def test_the_shared_blocks_are_counted_until_one_table_is_left():
    kv, parent, children = forked_three_times()
    assert kv.num_shared_blocks == 3                    # each held three times
    kv.free(children[0])
    assert kv.num_shared_blocks == 3                    # each held twice
    kv.free(children[1])
    assert kv.num_shared_blocks == 0
    kv.check_integrity()


def test_tables_swapped_in_together_share_their_blocks_again():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=8)
    parent = make_seq(make_request(1, 40, n=2))
    admit(kv, parent)
    finish_prompt(parent)
    child = fork(kv, parent, 10)
    kv.swap_out([parent, child])
    assert (kv.num_shared_blocks, kv.num_shared_block_refs) == (0, 0)
    kv.swap_in([parent, child])                         # one block each, two references
    assert (kv.num_shared_blocks, kv.num_shared_block_refs) == (3, 3)
    kv.check_integrity()


def test_the_integrity_check_catches_a_wrong_shared_block_count():
    kv, _, _ = forked_three_times()
    kv.pool.num_shared_blocks += 1
    with pytest.raises(AssertionError, match="shared-block count"):
        kv.check_integrity()


def test_a_prefix_hit_repeats_the_blocks_it_found():
    kv = PagedKVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_seq(make_request(1, 48, ids=(0, 1, 2)))
    b = make_seq(make_request(2, 48, ids=(0, 1, 5)))
    admit(kv, a)
    assert admit(kv, b) == 32                          # two blocks found
    assert kv.num_shared_block_refs == 2
    kv.check_integrity()


def counted_step(sched):
    """One scheduler step; with it (repeat tokens, first-repeat tokens) as the simulator's
    executor counts them while the step runs."""
    now = float(sched.step_id)
    plan = sched.schedule(now)
    counts = shared_read_tokens(plan, sched.kv, sched.running)
    sched.finish_step(plan, None, now + 1.0)
    sched.kv.check_integrity()
    return plan, counts


def test_a_decode_step_of_n_3_samples_carries_their_shared_prompt_blocks():
    sched = make_scheduler()
    sched.add_request(scheduler_request(0, 40, 5, n=3))
    step(sched)                                        # prefill 40 tokens, then the fork
    plan, (repeats, first) = counted_step(sched)       # 3 decodes of context 41
    # the partial third block was copied for two samples; the two full ones are held 3 times
    assert plan.decode_context_tokens == 3 * 41
    assert repeats == 2 * 2 * BS
    assert first == 2 * BS                             # the first repeat of each


def test_the_profiled_model_reads_shared_context_at_the_measured_saving(tmp_path):
    write_fit(tmp_path)
    items = [(1023, 1, True)] * 4
    plain = ProfiledCostModel.load(tmp_path / "fit.json", block_size=16)
    (tmp_path / SHARED_READS_FILE).write_text(json.dumps(
        {"format": "simkv-shared-reads-1", "saving": 0.45, "saving_first": 0.5,
         "saving_further": 0.5}))
    shared = ProfiledCostModel.load(tmp_path / "fit.json", block_size=16)
    shared.use_shared_reads(load_shared_reads(tmp_path))
    plan = plan_of(items, decode_shared_context_tokens=2048)
    # a_dec is 1e-8 s per token at block size 16 (test_profiled_costmodel.coefs)
    assert plain.predict(plan) - shared.predict(plan) == pytest.approx(0.5 * 1e-8 * 2048)
    assert shared.predict(plan_of(items)) == plain.predict(plan_of(items))
    assert shared.describe()["shared_reads"]["saving_first"] == 0.5


def shared_read_models(tmp_path, **savings):
    """The test fit without and with a shared_reads.json of `savings`."""
    write_fit(tmp_path)
    plain = ProfiledCostModel.load(tmp_path / "fit.json", block_size=16)
    (tmp_path / SHARED_READS_FILE).write_text(json.dumps(
        {"format": "simkv-shared-reads-1", **savings}))
    shared = ProfiledCostModel.load(tmp_path / "fit.json", block_size=16)
    shared.use_shared_reads(load_shared_reads(tmp_path))
    return plain, shared


def test_the_first_repeat_of_a_block_saves_its_own_share_and_further_repeats_theirs(tmp_path):
    plain, shared = shared_read_models(tmp_path, saving=0.5, saving_first=0.6,
                                       saving_further=0.4)
    # 4 decodes: 2,048 repeated tokens, 512 of them first repeats (32 blocks held 2 to 4 times)
    plan = plan_of([(1023, 1, True)] * 4, decode_shared_context_tokens=2048,
                   decode_shared_block_tokens=512)
    # a_dec is 1e-8 s per token at block size 16 (test_profiled_costmodel.coefs)
    assert plain.predict(plan) - shared.predict(plan) \
        == pytest.approx(1e-8 * (0.6 * 512 + 0.4 * 1536))
    assert shared.describe()["shared_reads"]["saving_first"] == 0.6
    assert shared.describe()["shared_reads"]["saving_further"] == 0.4


@pytest.mark.parametrize("content, match", [
    ("{", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"format": "simkv-shared-reads-1", "saving": 1.5, "saving_first": 0.5,
                 "saving_further": 0.5}), "in \\[0, 1\\]"),
    (json.dumps({"format": "other", "saving": 0.5}), "needs format"),
    (json.dumps({"format": "simkv-shared-reads-1", "saving": 0.5}), "saving_further in"),
    (json.dumps({"format": "simkv-shared-reads-1", "saving": 0.5, "saving_first": 1.5,
                 "saving_further": 0.4}), "saving_further in \\[0, 1\\]"),
    (json.dumps({"format": "simkv-shared-reads-1", "saving": 0.5, "saving_first": 0.5,
                 "saving_further": "0.4"}), "saving_further in \\[0, 1\\]")])
def test_a_bad_shared_reads_file_names_itself(tmp_path, content, match):
    (tmp_path / SHARED_READS_FILE).write_text(content)
    with pytest.raises(InputError, match=f"{SHARED_READS_FILE}.*{match}"):
        load_shared_reads(tmp_path)


def test_the_probes_repeated_tokens_are_the_groups_shared_prefixes():
    # 8 sequences of 1,024 tokens in pairs: 4 repeats of (1024 - 64) / 16 = 60 blocks
    assert repeated_tokens(8, 1024, 2, 16) == 4 * 60 * 16
    assert repeated_tokens(8, 1024, 1, 16) == 0


def test_the_probes_first_repeats_are_one_per_group_and_shared_block():
    # 8 sequences in two groups of 4: 3 repeats of each of 60 blocks per group, 1 of them first
    assert repeated_tokens(8, 1024, 4, 16) == 2 * 3 * 60 * 16
    assert first_repeat_tokens(8, 1024, 4, 16) == 2 * 60 * 16
    assert first_repeat_tokens(8, 1024, 2, 16) == repeated_tokens(8, 1024, 2, 16)
    assert first_repeat_tokens(8, 1024, 1, 16) == 0


def test_the_committed_saving_refits_from_its_committed_probe():
    from simkv.fitting.shared_reads import fit_shared_reads
    committed = json.loads((PROFILE / SHARED_READS_FILE).read_text())
    refit = fit_shared_reads([ROOT / p for p in committed["fit"]["probes"]], PROFILE)
    assert refit["saving"] == committed["saving"]
    assert 0.3 < refit["saving"] < 0.7
    assert (refit["saving_first"], refit["saving_further"]) \
        == (committed["saving_first"], committed["saving_further"])
    # pairs save more per repeat than the repeats within larger groups, and fit better for it
    assert refit["saving_first"] > refit["saving"] > refit["saving_further"]
    fit = refit["fit"]
    assert fit["adjacent_max_abs_step_error"] < fit["single_saving"]["adjacent_max_abs_step_error"]
    assert fit["adjacent_rms_step_error"] < fit["single_saving"]["adjacent_rms_step_error"]


def write_probe(path, savings, first_saving, further_saving, groups=(2, 8), spread=()):
    """A probe's steps.csv whose shared batches save exactly the given shares of their first
    and further repeats' reads (block size 16, a_dec from the bundled profile)."""
    model = ProfiledCostModel.load(PROFILE, block_size=16)
    rows = ["batch,context,group,spread,time_s"]
    for batch, context in savings:
        unshared = 0.01 * batch / 64
        rows.append(f"{batch},{context},1,False,{unshared!r}")
        for group in groups:
            first = first_repeat_tokens(batch, context, group, 16)
            further = repeated_tokens(batch, context, group, 16) - first
            saved = model.decode_token_seconds(batch) * (first_saving * first
                                                         + further_saving * further)
            rows.append(f"{batch},{context},{group},False,{unshared - saved!r}")
            if group in spread:                        # placement the model does not see
                rows.append(f"{batch},{context},{group},True,{unshared!r}")
    path.mkdir(exist_ok=True)
    (path / "steps.csv").write_text("\n".join(rows) + "\n")
    return path


def test_the_fit_recovers_the_two_savings_of_a_synthetic_probe(tmp_path):
    from simkv.fitting.shared_reads import fit_shared_reads
    probe = write_probe(tmp_path / "probe", [(64, 1024), (128, 2048)], 0.7, 0.3,
                        groups=(2, 8, 64), spread=(2,))
    result = fit_shared_reads(probe, PROFILE)
    assert (result["saving_first"], result["saving_further"]) == (0.7, 0.3)
    assert result["fit"]["adjacent_max_abs_step_error"] == 0
    assert result["fit"]["single_saving"]["adjacent_max_abs_step_error"] > 0.01
    assert result["fit"]["adjacent_cases"] == 6        # the spread pairs are not fitted
    assert all(case["step_error"] == 0 for case in result["cases"] if not case["spread"])


def test_a_probe_of_pairs_only_gives_its_one_saving_to_both(tmp_path):
    from simkv.fitting.shared_reads import fit_shared_reads
    probe = write_probe(tmp_path / "probe", [(64, 1024), (128, 2048)], 0.7, 0.3, groups=(2,))
    result = fit_shared_reads(probe, PROFILE)
    assert result["saving"] == result["saving_first"] == result["saving_further"] == 0.7


def test_the_bundled_profile_is_simulated_with_its_shared_read_saving():
    from simkv.config.scenario import load_scenario
    from simkv.costmodel import load_cost_model
    committed = json.loads((PROFILE / SHARED_READS_FILE).read_text())
    saving = committed["saving"]
    scn = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    assert load_cost_model(scn).shared_reads["saving"] == pytest.approx(saving)
    assert load_cost_model(scn).shared_reads["saving_first"] \
        == pytest.approx(committed["saving_first"])
    fixed = load_scenario(ROOT / "scenarios" / "quickstart.yaml", {"gpu_clock": "fixed"})
    assert load_cost_model(fixed).shared_reads["saving"] == pytest.approx(saving)


def test_a_probe_without_the_unshared_batch_names_what_is_missing(tmp_path):
    from simkv.fitting.shared_reads import fit_shared_reads
    (tmp_path / "steps.csv").write_text("batch,context,group,spread,time_s\n"
                                        "64,1024,2,False,0.007\n")
    with pytest.raises(InputError, match="no unshared batch .group 1. of batch 64, context 1024"):
        fit_shared_reads(tmp_path, PROFILE)


def test_a_decode_beside_prefills_that_share_a_prefix_among_themselves_repeats_nothing():
    # two prompts with the same 32-token prefix are prefilled while an unrelated one decodes
    sched = make_scheduler()
    sched.add_request(scheduler_request(0, 20, 5))
    step(sched)                                        # request 0 prefilled
    sched.add_request(scheduler_request(1, 48, 5, ids=(7, 8, 9)))
    sched.add_request(scheduler_request(2, 48, 5, ids=(7, 8, 10)))
    plan, (repeats, _) = counted_step(sched)
    assert [it.is_decode for it in plan.scheduled].count(True) == 1
    assert sched.kv.num_shared_block_refs == 2           # the prefix, held twice
    assert repeats == 0


def test_repeats_count_only_among_the_decodes_a_step_schedules():
    # two requests of n = 2 hold their prompts' blocks twice each; a token budget of 2 decodes
    # request 0's pair and leaves request 1's out, whose repeats are not read
    sched = make_scheduler()
    for rid in (0, 1):
        sched.add_request(scheduler_request(rid, 40, 5, n=2))
    step(sched)                                        # both prefilled, then the forks
    assert sched.kv.num_shared_block_refs == 2 * 3     # the partial block too, until written
    sched.max_num_batched_tokens = 2
    plan, counts = counted_step(sched)
    assert [(item.seq.request.request_id, item.is_decode) for item in plan.scheduled] \
        == [(0, True), (0, True)]
    assert counts == (2 * BS, 2 * BS)                  # a pair: every repeat is a first one
    sched.max_num_batched_tokens = 3                   # one of request 1's samples too
    plan, counts = counted_step(sched)
    assert sum(item.is_decode for item in plan.scheduled) == 3
    assert counts == (2 * BS, 2 * BS)


def test_the_shares_of_tables_outside_a_step_are_counted_per_block():
    kv, parent, children = forked_three_times()
    assert kv.num_shared_block_refs == 2 * 3           # 3 blocks held three times
    assert kv.shared_refs_of([children[0]]) == 3       # one holder fewer of each
    assert kv.shared_refs_of(children) == 2 * 3        # two fewer: no repeat left
    assert kv.shared_refs_of([parent, *children]) == 2 * 3     # never more than the repeats


def test_blocks_that_at_most_one_table_outside_holds_drop_out_of_the_shared_blocks():
    kv, parent, children = forked_three_times()
    assert kv.shared_of([children[0]]) == (3, 0)       # two holders left: still shared
    assert kv.shared_of(children) == (2 * 3, 3)        # one left: no longer shared
    assert kv.shared_of([parent, *children]) == (2 * 3, 3)
