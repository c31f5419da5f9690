"""Multimodal keys per block: an item's identity keys only the blocks its placeholder tokens
overlap (canonical-CSV column `mm_spans`, items `offset:length:id`).

vLLM v0.26, vllm/v1/core/kv_cache_utils.py: generate_block_hash_extra_keys adds, for the block
of tokens [start, end), the keys _gen_mm_extra_hash_keys gives: (identifier, offset - start)
for each item with end > offset and start < offset + length (an item the block has passed,
start >= offset + length, is skipped; one it has not reached, end <= offset, ends the scan),
sorted by offset. hash_block_tokens chains them into the block's hash, so every block from the
first one an item touches differs between two images, and the blocks before it do not.

Block size 16. The image in most tests: 30 placeholder tokens at offset 40 (tokens 40..69),
which blocks 2 (32..47), 3 (48..63) and 4 (64..79) overlap.
"""
from pathlib import Path

import pandas as pd
import pytest

from simkv.cli import run_cli
from simkv.engine.kv.hashing import extend_block_hashes, hash_root, mm_extra_keys
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.request import Request, Sequence, stable_key
from simkv.errors import InputError
from simkv.sim.engine import Simulation
from simkv.workload.frames import requests_from_frame
from simkv.workload.traces import load_trace, trace_stats, write_canonical
from tests.test_kv_manager import admit
from tests.test_multiturn import scenario

BS = 16
IDS = tuple(range(6))            # the same 96 prompt tokens (text and placeholders) for all


def request(rid, spans=(), prompt=96, mm_key="", parent=None, output=8):
    req = Request(rid, 0.0, prompt, output, prefix_ids=IDS[:-(-prompt // BS)],
                  prefix_block_tokens=BS, mm_key=mm_key,
                  mm_spans=tuple((o, n, stable_key(k)) for o, n, k in spans) or None,
                  parent=parent)
    req.hash_root = hash_root(req, False)
    return req


def hashes(req, blocks=5, token_ids=None):
    seq = Sequence(req.request_id, req, 0, req.prompt_tokens, token_ids=token_ids)
    return extend_block_hashes(seq, blocks, BS)


def test_extra_keys_are_the_overlapping_items_with_their_offsets_in_the_block():
    spans = ((40, 30, 7),)
    assert [mm_extra_keys(spans, 16 * i, 16 * (i + 1)) for i in range(6)] == [
        (), (), ((7, 8),), ((7, -8),), ((7, -24),), ()]


def test_a_block_that_ends_at_an_item_or_starts_after_it_has_no_key_of_it():
    spans = ((32, 16, 7),)          # exactly block 2
    assert mm_extra_keys(spans, 16, 32) == ()          # end == offset: not reached
    assert mm_extra_keys(spans, 32, 48) == ((7, 0),)
    assert mm_extra_keys(spans, 48, 64) == ()          # start == offset + length: passed


def test_a_block_holding_two_items_has_both_keys_in_order():
    assert mm_extra_keys(((4, 2, 1), (10, 2, 2)), 0, 16) == ((1, 4), (2, 10))


def test_text_before_an_image_is_shared_across_images():
    cat, dog = hashes(request(0, [(40, 30, "cat")])), hashes(request(1, [(40, 30, "dog")]))
    assert cat[:2] == dog[:2] and not set(cat[2:]) & set(dog[2:])


def test_the_same_image_at_the_same_offset_shares_every_block():
    assert hashes(request(0, [(40, 30, "cat")])) == hashes(request(1, [(40, 30, "cat")]))


def test_the_same_image_one_token_later_is_another_block():
    """The offset inside the block is part of the key (vLLM v0.26 keys it so that one item at
    two positions of identical placeholder blocks stays apart)."""
    a, b = hashes(request(0, [(40, 30, "cat")])), hashes(request(1, [(41, 30, "cat")]))
    assert a[:2] == b[:2] and a[2] != b[2]


def test_an_mm_key_without_spans_still_keys_every_block():
    cat, dog = hashes(request(0, mm_key="cat")), hashes(request(1, mm_key="dog"))
    assert not set(cat) & set(dog)


def test_the_real_engines_token_hashes_take_the_same_keys():
    tokens = list(range(96))
    cat = hashes(request(0, [(40, 30, "cat")]), token_ids=tokens)
    dog = hashes(request(1, [(40, 30, "dog")]), token_ids=tokens)
    assert cat[:2] == dog[:2] and cat[2] != dog[2]


def test_a_turn_keeps_its_parents_image_keys():
    parent = request(0, [(40, 30, "cat")], prompt=80, output=16)
    child = request(1, prompt=96, parent=parent)
    assert hashes(child, 6)[:6] == hashes(parent, 6)[:6]


def test_a_second_image_request_hits_the_text_before_its_image():
    kv = PagedKVCacheManager(16, BS)
    cat = Sequence(0, request(0, [(40, 30, "cat")]), 0, 96)
    assert admit(kv, cat) == 0
    dog = Sequence(1, request(1, [(40, 30, "dog")]), 0, 96)
    assert kv.prefix_lookup(dog) == ([0, 1], 32)


# --- the canonical CSV column ----------------------------------------------------------------

HEADER = "arrival_s,prompt_tokens,output_tokens,prefix_ids,prefix_block_tokens,mm_spans\n"
TRACE = HEADER + ("0.0,96,8,0 1 2 3 4 5,16,40:30:cat.png\n"
                  "1.0,96,8,0 1 2 3 4 5,16,40:30:dog.png 80:10:a:b\n"
                  "2.0,96,8,0 1 2 3 4 5,16,\n")


def write(tmp_path, text, name="mm.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_mm_spans_are_read_sorted_and_become_integer_keys(tmp_path):
    df = load_trace(write(tmp_path, HEADER + "0,96,8,,,80:10:b 4:2:a\n"))
    assert df["mm_spans"].tolist() == [((4, 2, "a"), (80, 10, "b"))]
    (req,) = requests_from_frame(df)
    assert req.mm_spans == ((4, 2, stable_key("a")), (80, 10, stable_key("b")))


def test_ids_may_hold_colons_and_the_column_round_trips(tmp_path):
    original = load_trace(write(tmp_path, TRACE))
    assert original["mm_spans"][1] == ((40, 30, "dog.png"), (80, 10, "a:b"))
    assert original["mm_spans"][2] is None
    out = write_canonical(original, tmp_path / "out.csv")
    assert out.read_text().splitlines()[2].endswith(",40:30:dog.png 80:10:a:b")
    pd.testing.assert_frame_equal(load_trace(out), original)
    assert trace_stats(original)["mm_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("cell,expected", [
    ("40:30", "item '40:30' is not offset:length:id"),
    ("x:30:cat", "item 'x:30:cat' is not offset:length:id"),
    ("-1:30:cat", "item '-1:30:cat' is not offset:length:id"),
    ("40:30:", "item '40:30:' is not offset:length:id"),
    ("40:0:cat", "item '40:0:cat' must cover 1 or more tokens inside the prompt of 96"),
    ("80:17:cat", "item '80:17:cat' must cover 1 or more tokens inside the prompt of 96"),
    ("40:30:cat 60:5:dog", "items 40:30:cat and 60:...:dog overlap"),
])
def test_a_bad_span_is_an_error_naming_the_line_and_column(tmp_path, cell, expected):
    path = write(tmp_path, HEADER + f"0,96,8,,,{cell}\n")
    with pytest.raises(InputError) as error:
        load_trace(path)
    message = str(error.value)
    assert message.startswith(f"{path}: line 2: mm_spans: ") and expected in message


def test_trace_commands_read_and_write_mm_spans(tmp_path, capsys):
    path = write(tmp_path, TRACE)
    assert run_cli(["trace", "convert", str(path), str(tmp_path / "out.csv")]) == 0
    assert load_trace(tmp_path / "out.csv")["mm_spans"][0] == ((40, 30, "cat.png"),)
    bad = write(tmp_path, HEADER + "0,9,1,,,8:2:x\n", "bad.csv")
    assert run_cli(["trace", "stats", str(bad)]) == 2
    assert "mm_spans: item '8:2:x' must cover" in capsys.readouterr().err


def test_a_simulated_image_request_hits_the_system_prompt_before_its_image(tmp_path):
    requests = Simulation(scenario(write(tmp_path, TRACE))).run().requests
    # the dog request and the text-only one both hit blocks 0-1 of the cat request: block 2
    # (tokens 32..47) already holds 8 of the cat's placeholder tokens
    assert requests["cached_tokens"].tolist() == [0, 32, 32]
