"""Bad input never hangs, lies or crashes (issue 29): the matrix.

Every case is one bad input through one entry point (scenario YAML, `--set`, a trace, a model
config.json, a checks file, a command's flag), run in process through `simkv.cli.run_cli`, and
must end the same way: exit 2, exactly one line on stderr, `error: ...`, naming the file (or
flag), the key and, for a trace, the line; no traceback (run_cli re-raises anything that is not
bad input, which fails the case). The numeric cases are generated from the table of rules in
simkv.limits, so a key added there is tried here: not finite, below and above its interval,
not an integer, not a number. docs/fuzzing.md counts the cases by entry point and class.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from simkv.cli import run_cli
from simkv.config.keys import KEY_TYPES
from simkv.limits import MAX_TOKENS, RULES, rule_for

REPO = Path(__file__).resolve().parent.parent
SYNTHETIC = {"num_requests": 3, "arrival": {"process": "poisson", "rate": 2},
             "prompt_tokens": {"dist": "fixed", "value": 32},
             "output_tokens": {"dist": "fixed", "value": 4}}
BASE = {"model": "llama-3.1-8b", "workload": {"synthetic": SYNTHETIC}}
CLUSTER = {"pools": [{"name": "a", "replicas": 1}]}


@dataclass
class Case:
    entry: str                       # entry point, for the counts in docs/fuzzing.md
    kind: str                        # class of bad input
    name: str
    argv: Callable[[Path], list]     # the command line, given the case's folder
    expect: tuple                    # texts the one error line must contain


def write(folder: Path, name: str, content) -> str:
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(yaml.safe_dump(content, sort_keys=False))
    return name


def nested(dotted: str, value) -> dict:
    """A scenario dict with `dotted` set to `value` on top of BASE (a cluster for cluster.*,
    a cost_model mapping for cost_model.*, pools by index)."""
    scn = json.loads(json.dumps(BASE))
    parts = dotted.split(".")
    if parts[0] == "cluster":
        scn["cluster"] = json.loads(json.dumps(CLUSTER))
    if parts[0] == "cost_model":
        scn["cost_model"] = {}
    synthetic = scn["workload"]["synthetic"]
    if dotted.startswith("workload.synthetic.shared_prefix."):
        synthetic["shared_prefix"] = {"num_groups": 2, "prefix_tokens": 16, "fraction": 0.5}
    if dotted == "workload.synthetic.arrival.cv":
        synthetic["arrival"] = {"process": "gamma", "rate": 2, "cv": 2}
    node = scn
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        node = node.setdefault(part, {} if not parts[i + 1].isdigit() else [])
    node[parts[-1]] = value
    return scn


# --- the numeric keys and their bad values ---------------------------------------------------

def scenario_keys() -> list[str]:
    """Every numeric scenario key with a rule: the settable ones, the cluster's, the SLO's and
    the generator's (workload.synthetic.*)."""
    keys = [k for k, (kind, _) in KEY_TYPES.items() if kind in (int, float)]
    keys += ["slo.ttft_s", "slo.tpot_p90_s", "cluster.pools.0.replicas",
             "cluster.pools.0.cache.block_size", "cluster.pools.0.scheduler.max_num_seqs"]
    keys += [k for k in RULES if k.startswith(("cluster.router.", "cluster.kv_transfer."))]
    keys += [k for k in RULES if k.startswith("workload.synthetic.")
             and k != "workload.synthetic.duration_s"]    # one of it and num_requests
    keys += ["workload.synthetic.prompt_tokens.value", "workload.synthetic.n"]
    return keys


def rule_of(key: str):
    if key.startswith("workload.synthetic."):
        leaf = key.rsplit(".", 1)[-1]
        return RULES.get(key) or RULES["n" if leaf == "n" else "lengths"]
    return rule_for(key)


def bad_values(rule) -> list[tuple]:
    """(class, value) pairs that break `rule`."""
    below = rule.low if rule.low_open else rule.low - 1
    above = rule.high * 2 + 1
    if rule.kind is int:
        below, above = int(below), int(above)
    out = [("not finite", math.nan), ("not finite", math.inf),
           ("out of range", below), ("out of range", above), ("wrong type", "abc"),
           ("wrong type", True)]
    if rule.kind is int:
        out.append(("not an integer", rule.low + 0.5))
    return out


def _yaml_case(key, kind, value, entry):
    scenario = nested(key, value)

    def argv(tmp):
        name = write(tmp, "s.yaml", scenario)
        return {"run": ["run", name, "--out", "out"],
                "sweep": ["sweep", name, "--grid", "seed=0,1", "--out", "sw"],
                "capacity": ["capacity", name, "--set", "slo.e2e_s=100"],
                "explain": ["explain", name, "--step", "1"]}[entry]
    return Case(entry if entry == "run" else f"{entry} (scenario)", kind,
                f"yaml-{entry}-{key}={value!r}", argv, ("s.yaml", *named(key)))


def named(key: str) -> tuple:
    """What an error about `key` names: a pool's own keys after the pool (`cluster.pools.0
    (a): cache.block_size`), others whole."""
    parts = key.split(".")
    if parts[:2] == ["cluster", "pools"] and len(parts) > 4:
        return ".".join(parts[:3]), ".".join(parts[3:])
    return (key,)


def _set_case(key, kind, value):
    text = {True: "yes"}.get(value, str(value)) if not isinstance(value, float) \
        else repr(value)
    base = nested(key, None)                 # the key's section and siblings; --set gives it
    if key.startswith("workload.synthetic."):
        expect = ("s.yaml", key)             # the generator's keys: where they end up
    elif len(named(key)) > 1:
        expect = named(key)                  # a pool's: --set (its type) or the pool (range)
    else:
        expect = ("--set", key)

    def argv(tmp):
        return ["run", write(tmp, "s.yaml", base), "--out", "out", "--set", f"{key}={text}"]
    return Case("--set", kind, f"set-{key}={text}", argv, expect)


def numeric_cases() -> list[Case]:
    cases = []
    entries = ("run", "sweep", "capacity", "explain")
    i = 0
    for key in scenario_keys():
        rule = rule_of(key)
        for kind, value in bad_values(rule):
            cases.append(_yaml_case(key, kind, value, entries[i % len(entries)]))
            i += 1
            if value is not True and value != -math.inf and value != rule.low + 0.5 \
                    and not (isinstance(value, (int, float)) and value < rule.high):
                cases.append(_set_case(key, kind, value))
    return cases


# --- hardware, strict YAML, encoding, structure ----------------------------------------------

def scenario_cases() -> list[Case]:
    def yaml_text(text, entry="run"):
        def argv(tmp):
            name = write(tmp, "s.yaml", text)
            return {"run": ["run", name, "--out", "out"],
                    "sweep": ["sweep", name, "--grid", "seed=0,1", "--out", "sw"],
                    "check": ["check", write(tmp, "c.yaml", {"checks": [
                        {"name": "c", "scenario": name, "expect": {"leaked_blocks": "== 0"}}]})]
                    }[entry]
        return argv
    good = yaml.safe_dump(BASE, sort_keys=False)
    cases = []
    for budget in (141, 200, 2000, 4096):
        cases.append(Case("run", "above the hardware", f"budget {budget} GiB on h200",
                          yaml_text(good + f"cache: {{memory_budget_gib: {budget}}}\n"),
                          ("s.yaml", "cache.memory_budget_gib", "h200's memory")))
    for gpu, budget in (("h100", 81), ("a100-80gb", 81), ("l40s", 49)):
        cases.append(Case("run", "above the hardware", f"budget {budget} GiB on {gpu}",
                          yaml_text(good + f"gpu: {gpu}\ncache: {{memory_budget_gib: "
                                           f"{budget}}}\n"),
                          ("s.yaml", "cache.memory_budget_gib", f"{gpu}'s memory")))
    cases.append(Case("run", "above the hardware", "a pool past the simulator's blocks",
                      yaml_text(good.replace("llama-3.1-8b", "tiny")),
                      ("s.yaml", "cache.block_size", "more than the simulator holds")))
    cases.append(Case("run", "above the hardware", "host swap past the simulator's blocks",
                      yaml_text(good.replace("llama-3.1-8b", "tiny")
                                + "cache: {block_size: 4096, swap_space_gib: 4096}\n"),
                      ("s.yaml", "cache.block_size")))
    duplicates = {
        "a second cache section": good + "cache: {block_size: 16}\ncache: {block_size: 32}\n",
        "a key twice in a section": good + "cache: {block_size: 16, block_size: 32}\n",
        "model twice": good + "model: llama-3.1-70b\n",
        "a generator key twice": good.replace("num_requests: 3", "num_requests: 3\n    "
                                                                "num_requests: 4"),
    }
    for entry in ("run", "sweep", "check"):
        for name, text in duplicates.items():
            cases.append(Case(f"{entry} (scenario)" if entry != "run" else "run",
                              "strict YAML", f"{entry}: {name}", yaml_text(text, entry),
                              ("s.yaml", "duplicate key")))
        for where, data in (("a value", good.encode() + b"name: caf\xe9\n"),
                            ("a comment", b"# \xff\xfe\n" + good.encode()),
                            ("latin-1 text", good.encode() + b"name: na\xefve\n")):
            cases.append(Case(f"{entry} (scenario)" if entry != "run" else "run",
                              "not UTF-8", f"{entry}: non-UTF-8 {where}",
                              yaml_text(data, entry), ("s.yaml", "not UTF-8")))
    structure = {
        "a list for cache": (good + "cache: [16]\n", "cache"),
        "a string for slo": (good + "slo: fast\n", "slo"),
        "a mapping for a number": (good + "cache: {block_size: {a: 1}}\n", "cache.block_size"),
        "a list for a number": (good + "scheduler: {max_num_seqs: [1]}\n",
                                "scheduler.max_num_seqs"),
        "a YAML 1.1 exponent": (good + "cache: {swap_space_gib: 1e3}\n", "1.0e12"),
        "null for a required number": (good + "cache: {block_size: null}\n",
                                       "cache.block_size"),
        "a list key": (good + "? [a]\n: 1\n", "unhashable"),
    }
    for name, (text, key) in structure.items():
        cases.append(Case("run", "wrong type", name, yaml_text(text), ("s.yaml", key)))
    return cases


# --- traces ------------------------------------------------------------------------------------

CANONICAL = "arrival_s,prompt_tokens,output_tokens{extra}\n0.0,32,4{row0}\n{row}\n"
CANONICAL_BAD = {
    "arrival_s": [("not finite", "nan"), ("not finite", "inf"), ("out of range", "-1"),
                  ("out of range", "2e9"), ("wrong type", "abc")],
    "prompt_tokens": [("out of range", "0"), ("out of range", "-1"),
                      ("not an integer", "1.5"), ("out of range", "1e20"),
                      ("out of range", str(MAX_TOKENS + 1)), ("not finite", "nan"),
                      ("wrong type", "abc")],
    "output_tokens": [("out of range", "0"), ("not an integer", "2.5"),
                      ("out of range", "1e20"), ("not finite", "inf"), ("wrong type", "x")],
    "n": [("out of range", "0"), ("not an integer", "1.5"), ("out of range", "2000"),
          ("wrong type", "two")],
    "cancel_after_s": [("out of range", "-1"), ("not finite", "nan"), ("out of range", "2e9")],
}


def trace_cases() -> list[Case]:
    cases = []

    def argv_of(entry, name, content):
        def argv(tmp):
            path = write(tmp, name, content)
            if entry == "trace stats":
                return ["trace", "stats", path]
            if entry == "trace convert":
                return ["trace", "convert", path, "out.csv"]
            return ["run", write(tmp, "s.yaml", BASE), "--trace", path, "--out", "out"]
        return argv

    entries = ("trace stats", "run --trace", "trace convert")
    for column, values in CANONICAL_BAD.items():
        for kind, text in values:
            if column in ("arrival_s", "prompt_tokens", "output_tokens"):
                row = {"arrival_s": "1.0", "prompt_tokens": "32", "output_tokens": "4"}
                row[column] = text
                content = CANONICAL.format(extra="", row0="", row=",".join(row.values()))
            else:
                good = "1" if column == "n" else ""
                content = CANONICAL.format(extra=f",{column}", row0=f",{good}",
                                           row=f"1.0,32,4,{text}")
            for entry in entries[:2] if column != "arrival_s" else entries:
                cases.append(Case(entry, kind, f"canonical {column}={text} ({entry})",
                                  argv_of(entry, "t.csv", content), ("t.csv", "line 3", column)))
    azure = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,{c},{g}\n"
    for column, kind, c, g in (("ContextTokens", "out of range", "1e20", "4"),
                               ("ContextTokens", "out of range", "-1", "4"),
                               ("ContextTokens", "not an integer", "1.5", "4"),
                               ("ContextTokens", "wrong type", "many", "4"),
                               ("GeneratedTokens", "out of range", "32", "1e20"),
                               ("GeneratedTokens", "not finite", "32", "nan")):
        for entry in entries[:2]:
            cases.append(Case(entry, kind, f"azure {column}={c if column[0] == 'C' else g}"
                              f" ({entry})", argv_of(entry, "a.csv", azure.format(c=c, g=g)),
                              ("a.csv", "line 2", column)))
    line = {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]}
    for key, kind, value in (("input_length", "out of range", 10**20),
                             ("input_length", "out of range", -1),
                             ("input_length", "not an integer", 1.5),
                             ("input_length", "wrong type", "600"),
                             ("output_length", "out of range", 2**63),
                             ("output_length", "wrong type", None),
                             ("timestamp", "out of range", 10**20),
                             ("hash_ids", "out of range", [0, 10**30]),
                             ("hash_ids", "wrong type", ["a", "b"])):
        bad = {**line, key: value}
        content = json.dumps(line) + "\n" + json.dumps(bad) + "\n"
        for entry in entries[:2]:
            cases.append(Case(entry, kind, f"mooncake {key}={value!r} ({entry})",
                              argv_of(entry, "m.jsonl", content), ("m.jsonl", "line 2", key)))
    burst = "Timestamp,Request tokens,Response tokens\n0,32,4\n{t},{r},{s}\n"
    for column, kind, t, r, s in (("Timestamp", "not finite", "nan", "32", "4"),
                                  ("Request tokens", "out of range", "1", "1e20", "4"),
                                  ("Response tokens", "not an integer", "1", "32", "4.5")):
        for entry in entries[:2]:
            cases.append(Case(entry, kind, f"burstgpt {column} ({entry})",
                              argv_of(entry, "b.csv", burst.format(t=t, r=r, s=s)),
                              ("b.csv", "line 3", column)))
    for entry in entries[:2]:
        cases.append(Case(entry, "not UTF-8", f"a non-UTF-8 canonical trace ({entry})",
                          argv_of(entry, "t.csv", b"arrival_s,prompt_tokens,output_tokens\n"
                                                  b"0,32,4\n1,\xff,4\n"),
                          ("t.csv", "line 3", "UTF-8")))
        cases.append(Case(entry, "not UTF-8", f"a non-UTF-8 Mooncake trace ({entry})",
                          argv_of(entry, "m.jsonl", json.dumps(line).encode() + b"\n"
                                  + b'{"timestamp": 1, "x": "\xe9"}\n'),
                          ("m.jsonl", "line 2", "UTF-8")))
    return cases


# --- model configs -----------------------------------------------------------------------------

MODEL_BAD = [
    ("num_key_value_heads", "wrong type", "8"), ("num_key_value_heads", "out of range", 0),
    ("num_key_value_heads", "out of range", -8), ("num_key_value_heads", "not an integer", 8.5),
    ("num_key_value_heads", "out of range", 10**20), ("num_key_value_heads", "not finite",
                                                      math.nan),
    ("head_dim", "wrong type", "abc"), ("head_dim", "not an integer", 127.5),
    ("head_dim", "out of range", 0), ("head_dim", "not finite", math.inf),
    ("num_hidden_layers", "out of range", 10**30), ("num_hidden_layers", "out of range", -1),
    ("hidden_size", "wrong type", "4096"), ("hidden_size", "wrong type", True),
    ("rope_theta", "wrong type", "x"), ("rope_theta", "out of range", -1.0),
    ("rope_theta", "not finite", math.nan), ("rope_theta", "not finite", math.inf),
    ("rms_norm_eps", "out of range", 0), ("rms_norm_eps", "wrong type", "1e-5"),
    ("max_position_embeddings", "out of range", 0),
    ("max_position_embeddings", "not an integer", 1.5),
]


def model_cases() -> list[Case]:
    config = json.loads((REPO / "profiles" / "models" / "llama-3.1-8b.json").read_text())
    cases = []
    for field, kind, value in MODEL_BAD:
        text = json.dumps({**config, field: value})      # NaN and Infinity as Python writes them
        for entry in ("size --model", "run (model config)"):
            def argv(tmp, text=text, entry=entry):
                (tmp / "m").mkdir()
                write(tmp / "m", "config.json", text)
                if entry == "size --model":
                    return ["size", "--model", "m/config.json"]
                return ["run", write(tmp, "s.yaml", {**BASE, "model": "m/config.json"}),
                        "--out", "out"]
            cases.append(Case(entry, kind, f"config {field}={value!r} ({entry})", argv,
                              ("config.json", field)))
    return cases


# --- checks files ------------------------------------------------------------------------------

def checks_cases() -> list[Case]:
    scenario = {"name": "c", "scenario": "s.yaml", "expect": {"leaked_blocks": "== 0"}}

    def checks(content):
        def argv(tmp):
            write(tmp, "s.yaml", BASE)
            return ["check", write(tmp, "c.yaml", content)]
        return argv
    cases = []
    for bound in ("<= .nan", ">= .inf", "< -.inf", "== .nan", "!= .nan", "<= nan", ">= inf",
                  "<= 1e400"):
        cases.append(Case("check", "not finite", f"bound {bound!r}",
                          checks({"checks": [{**scenario, "expect": {"ttft_s.p90": bound}}]}),
                          ("c.yaml", "ttft_s.p90")))
    for bound in (math.nan, math.inf):
        cases.append(Case("check", "not finite", f"bare bound {bound!r}",
                          checks({"checks": [{**scenario, "expect": {"ttft_s.p90": bound}}]}),
                          ("c.yaml", "ttft_s.p90")))
    for key, value in (("cache.block_size", math.nan), ("cache.memory_budget_gib", 500),
                       ("workload.time_scale", math.inf), ("scheduler.max_num_seqs", 1.5)):
        cases.append(Case("check", "not finite" if isinstance(value, float)
                          and not math.isfinite(value) else "out of range",
                          f"set {key}={value!r}",
                          checks({"checks": [{**scenario, "set": {key: value}}]}),
                          ("c.yaml", key)))
    dup = ("checks:\n  - name: c\n    scenario: s.yaml\n    expect: {leaked_blocks: '== 0'}\n"
           "    expect: {leaked_blocks: '== 1'}\n")
    cases.append(Case("check", "strict YAML", "expect twice", checks(dup),
                      ("c.yaml", "duplicate key")))
    cases.append(Case("check", "not UTF-8", "a non-UTF-8 checks file",
                      checks(b"checks:\n  - name: \xe9t\xe9\n"), ("c.yaml", "not UTF-8")))
    return cases


# --- flags -------------------------------------------------------------------------------------

def flag_cases() -> list[Case]:
    size = ["size", "--model", "llama-3.1-8b"]
    flags = {
        "--memory-budget-gib": ["nan", "inf", "-inf", "-1", "0", "200", "5000", "1e400"],
        "--gpu-memory-utilization": ["nan", "inf", "0", "-0.5", "1.5"],
        "--block-size": ["0", "-16", "3", "4096"],
        "--max-num-seqs": ["0", "-1", "100000000000000000000"],
        "--max-num-batched-tokens": ["0", "-8192", str(2**40)],
    }
    cases = []
    for flag, values in flags.items():
        for text in values:
            kind = ("not finite" if text.lstrip("-") in ("nan", "inf", "1e400")
                    else "above the hardware" if flag == "--memory-budget-gib"
                    and text in ("200", "5000") else "out of range")
            cases.append(Case("size flags", kind, f"size {flag} {text}",
                              lambda tmp, f=flag, t=text: [*size, f, t], (flag,)))

    def scenario_argv(*tail, scenario=BASE):
        return lambda tmp: [tail[0], write(tmp, "s.yaml", scenario), *tail[1:]]
    slo = {**BASE, "slo": {"ttft_s": 1.0}}
    fleet = {**slo, "cluster": CLUSTER}
    for flag, text in (("--tolerance", "nan"), ("--tolerance", "0"), ("--tolerance", "1"),
                       ("--tolerance", "-0.1"), ("--replicates", "0"),
                       ("--replicates", "5000")):
        cases.append(Case("capacity flags", "not finite" if text == "nan" else "out of range",
                          f"capacity {flag} {text}",
                          scenario_argv("capacity", flag, text, scenario=slo), (flag,)))
    for flag, text in (("--rate", "nan"), ("--rate", "inf"), ("--rate", "0"),
                       ("--rate", "-2"), ("--gpu-budget", "0")):
        cases.append(Case("fleet flags", "not finite" if text in ("nan", "inf")
                          else "out of range", f"fleet {flag} {text}",
                          scenario_argv("fleet", "--rate", "1", flag, text, scenario=fleet),
                          (flag,)))
    for text in ("h200=nan", "h200=inf", "h200=-1", "h200="):
        cases.append(Case("fleet flags", "not finite" if "n" in text[5:] else "out of range",
                          f"fleet --gpu-price {text}",
                          scenario_argv("fleet", "--rate", "1", "--gpu-price", text,
                                        scenario=fleet), ("--gpu-price",)))
    for text in ("0", "-3"):
        cases.append(Case("explain flags", "out of range", f"explain --step {text}",
                          scenario_argv("explain", "--step", text), ("--step",)))
    for text in ("0", "-1"):
        cases.append(Case("sweep flags", "out of range", f"sweep --workers {text}",
                          scenario_argv("sweep", "--grid", "seed=0,1", "--workers", text,
                                        "--out", "sw"), ("--workers",)))
    for grid in ("cache.block_size=16,nan", "workload.time_scale=1,inf",
                 "cache.memory_budget_gib=20,500", "scheduler.max_num_seqs=8,1.5"):
        cases.append(Case("sweep flags", "out of range", f"sweep --grid {grid}",
                          scenario_argv("sweep", "--grid", grid, "--out", "sw"),
                          (grid.split("=")[0],)))
    return cases


def sweep_workload_cases() -> list[Case]:
    """Workload problems sweep finds before running any point (no empty folder left)."""
    cases = []
    for name, workload, expect in (
            ("a bad trace row", {"trace": "t.csv"}, ("t.csv", "line 3")),
            ("a bad generator value", {"synthetic": {**SYNTHETIC, "num_requests": 0}},
             ("s.yaml", "workload.synthetic.num_requests")),
            ("an unknown generator key", {"synthetic": {**SYNTHETIC, "colour": "red"}},
             ("s.yaml", "workload.synthetic.colour")),
            ("a generator that asks too much", {"synthetic": {**SYNTHETIC,
                                                              "num_requests": None,
                                                              "duration_s": 10**8}},
             ("s.yaml", "workload.synthetic.duration_s"))):
        def argv(tmp, workload=workload):
            write(tmp, "t.csv", CANONICAL.format(extra="", row0="", row="1,-3,4"))
            synthetic = workload.get("synthetic")
            if synthetic is not None:
                workload = {"synthetic": {k: v for k, v in synthetic.items() if v is not None}}
            return ["sweep", write(tmp, "s.yaml", {**BASE, "workload": workload}),
                    "--grid", "cache.block_size=16,32", "--out", "sw"]
        cases.append(Case("sweep (workload)", "row" if "row" in name else "out of range", name,
                          argv, expect))
    return cases


CASES = (numeric_cases() + scenario_cases() + trace_cases() + model_cases() + checks_cases()
         + flag_cases() + sweep_workload_cases())


def run_case(case: Case, tmp_path: Path, capsys, monkeypatch) -> tuple:
    monkeypatch.chdir(tmp_path)
    argv = case.argv(tmp_path)
    capsys.readouterr()
    code = run_cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_exits_2_with_one_error_line_naming_it(case, tmp_path, capsys, monkeypatch):
    code, out, err = run_case(case, tmp_path, capsys, monkeypatch)
    lines = err.splitlines()
    assert code == 2, (code, err, out[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in case.expect:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in out + err
    if case.entry.startswith("sweep"):
        assert not (tmp_path / "sw").exists()        # nothing ran, nothing written


def test_the_matrix_has_hundreds_of_cases_over_every_entry_point():
    entries = {c.entry.split(" ")[0] for c in CASES}
    assert len(CASES) >= 300
    assert {"run", "--set", "sweep", "capacity", "explain", "check", "size", "trace", "fleet",
            "run"} <= entries


def matrix_counts() -> dict:
    """{entry point: {class: cases}}, for docs/fuzzing.md (`python -m tests.test_bad_input`)."""
    counts: dict = {}
    for c in CASES:
        counts.setdefault(c.entry, {}).setdefault(c.kind, 0)
        counts[c.entry][c.kind] += 1
    return counts


USED_BY = {"slo": "every `slo.*` key", "lengths": "token lengths of `workload.synthetic` "
            "(`prompt_tokens`, `output_tokens`, `conversation.new_tokens`: value, min, max, "
            "mean)", "lognormal.sigma": "`sigma` of a lognormal length or time",
            "n": "`workload.synthetic.n`, a trace's `n`",
            "turns": "`workload.synthetic.conversation.turns`",
            "trace.tokens": "a trace row's token counts", "trace.seconds":
            "a trace row's arrival and cancel_after_s; a generated time",
            "model.int": "an integral `config.json` field", "model.number":
            "a real `config.json` field (rope_theta, rms_norm_eps)",
            "check.bound": "a checks-file bound", "cluster.pools.replicas":
            "`cluster.pools.N.replicas`"}


def limits_table() -> str:
    """The table of docs/fuzzing.md: every rule of simkv.limits, what it covers and its largest
    accepted value."""
    rows = ["| key | accepted | largest accepted |", "|---|---|---|"]
    for key, rule in RULES.items():
        name = USED_BY.get(key, f"`{key}`")
        high = rule.interval().rsplit(", ", 1)[1][:-1]
        largest = f"below {high}" if rule.high_open else high
        if key == "cache.memory_budget_gib":
            largest += " and the GPU's memory"
        rows.append(f"| {name} | {rule.describe()} | {largest} |")
    return "\n".join(rows)


def test_the_docs_state_every_rule_and_its_largest_value():
    assert limits_table() in (REPO / "docs" / "fuzzing.md").read_text()


if __name__ == "__main__":
    import sys
    if "--limits" in sys.argv:
        print(limits_table())
        sys.exit(0)
    counts = matrix_counts()
    kinds = sorted({k for v in counts.values() for k in v})
    print("| entry point | " + " | ".join(kinds) + " | all |")
    print("|---|" + "---|" * (len(kinds) + 1))
    for entry, by_kind in counts.items():
        print(f"| {entry} | " + " | ".join(str(by_kind.get(k, "")) for k in kinds)
              + f" | {sum(by_kind.values())} |")
    print("| all | " + " | ".join(str(sum(v.get(k, 0) for v in counts.values()))
                                   for k in kinds) + f" | {len(CASES)} |")
