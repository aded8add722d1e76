"""kvq-calibrate-hf --bits: the codec chosen for a transformers model as kvq-calibrate --bits
chooses it.

* the candidate list, lever names and constants are codec_search.cc's / codec_search.h's (read
  from the C++ sources: the two searches stay in step);
* every candidate name (with each key lever, the sinks and the sparse lever) parses to the
  settings and costs the bits that kvq-calibrate's codec-search.json files record for it;
* the choice rule: near-ties within the noise margin go to fewer bits (a constructed near-tie);
* SmolLM2 (the GGUF, loaded by transformers), a short calibration and a short search on the
  held-out validation windows after it: the choice is within the budget, codec.json holds it,
  and the C++ client (`kvq models register`, core's codec.json reader) registers the entry
  with exactly that codec; an impossible budget exits 2 naming --bits. The calibration, the
  registration and the check of the served model are the README's "Bring your own model"
  commands, run as written with the checkpoint, text, paths and address substituted and the
  short run's sizes appended (a later flag wins).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvq
from kvq._proto.kvq.v1 import kvq_pb2

from conftest import data_file

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvq.hf import codec_choice as cc  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _cpp(path: str) -> str:
    return (REPO / path).read_text(encoding="utf-8")


def test_names_and_constants_are_kvq_calibrates():
    src, hdr = _cpp("frontend/src/codec_search.cc"), _cpp("frontend/include/kvq/frontend/codec_search.h")
    block = re.search(r"kCandidates = \{(.*?)\};", src, re.S)
    levers = re.search(r"kLevers = \{(.*?)\};", src, re.S)
    assert block and levers
    assert tuple(re.findall(r'"([^"]+)"', block.group(1))) == cc.CANDIDATES
    assert tuple(re.findall(r'"([^"]*)"', levers.group(1))) == cc.KEY_LEVERS

    def const(name: str) -> str:
        m = re.search(rf"{name}(?:\[\])? = \"?([^\";]+)\"?;", hdr)
        assert m, name
        return m.group(1)

    assert const("kLeverProbe") == cc.LEVER_PROBE
    assert const("kSinkLever") == cc.SINK_LEVER
    assert int(const("kSparseLeverPermille")) == cc.SPARSE_LEVER_PERMILLE
    assert float(const("kSparseLeverMinGain")) == cc.SPARSE_LEVER_MIN_GAIN
    assert float(const("kChoiceNoiseMargin")) == cc.NOISE_MARGIN


@pytest.mark.parametrize("search", ["codec-search-smol.json", "codec-search-qwen.json",
                                    "codec-search-smol-sparse.json"])
def test_names_parse_and_cost_what_kvq_calibrate_recorded(search):
    """Every row kvq-calibrate wrote (its settings from eval_config.cc's parser, its bits from
    core's block sizes): the same settings and bits here."""
    js = json.loads(_cpp(f"docs/results/frontier/{search}"))
    rows = list(js["candidates"])
    for stage in ("key_lever_search", "sink_lever_search", "sparse_lever_search"):
        rows += js.get(stage, {}).get("candidates", []) if isinstance(js.get(stage), dict) else []
    assert len(rows) > 20
    defaults = cc.codec_of_name("kivi-kv2")[0].__dict__
    checked = 0
    for row in rows:
        settings, oblique = cc.codec_of_name(row["name"])
        assert oblique == row["oblique_basis"], row["name"]
        want = dict(row["settings"])
        got = settings.__dict__
        for key, value in got.items():
            # codec.json leaves fields added later out when they hold their default.
            assert value == want.get(key, defaults[key] if key not in ("key_bits", "value_bits") else None), \
                (row["name"], key)
        [planned] = cc.plan_rows([row["name"]], (2, 6, 64), 8, 99.0, int(js["window_len"]))
        assert (planned.k_bits, planned.v_bits, planned.sink_bits) == pytest.approx(
            (row["k_bits"], row["v_bits"], row["sink_bits"]), abs=1e-9), row["name"]
        assert planned.bits == pytest.approx(row["bits_per_element"], abs=1e-9)
        checked += 1
    assert checked == len(rows)


def test_levers_apply_as_in_kvq_calibrate():
    assert cc.with_key_lever("kivi-kv3-g128", "obl-mr") == "kivi-kv3-g128-mr"
    assert cc.with_key_lever("headq-kv3-g128", "obl-mr") == "headq-kv3-g128-obl-mr"
    assert cc.with_key_lever("headq-kv3-g128", "") == "headq-kv3-g128"
    assert cc.with_sparse_lever("headq-kv2-g128-mr") == "headq-kv2-g128-mr-sk5-sv5"
    assert cc.with_sparse_lever("headq-kv2-g128-rotk-mr") == "headq-kv2-g128-rotk-mr-sv5"
    assert cc.with_sparse_lever("kivi-kv2-rot") == "kivi-kv2-rot"
    with pytest.raises(ValueError, match="'a2' is not a codec setting"):
        cc.codec_of_name("headq-kv2-a2")
    with pytest.raises(ValueError, match="expected headq-kv"):
        cc.codec_of_name("headq-k2")


def _row(bits: float, ppl: float, skipped: str = "") -> SimpleNamespace:
    return SimpleNamespace(bits=bits, ppl=ppl, skipped=skipped)


def test_near_ties_within_the_margin_go_to_fewer_bits():
    m = cc.NOISE_MARGIN
    rows = [_row(3.5, 16.0), _row(3.0, 16.0 * (1 + m / 2)), _row(3.0, 16.0 * (1 + m / 4)),
            _row(2.0, 16.0 * (1 + 2 * m)), _row(1.0, 1.0, skipped="over")]
    assert cc.choose_within(rows, 9.0) == 1  # the fewest bits of the near-ties, then the earlier row
    assert cc.choose_within(rows, 2.5) == 3  # alone within 2.5 bits
    assert cc.choose_within(rows, 0.5) == -1
    assert cc.choose_within(rows, 9.0, margin=0.0) == 0  # no margin: the lowest perplexity
    rows[1].ppl = 16.0 * (1 + 2 * m)  # beyond the margin now
    assert cc.choose_within(rows, 9.0) == 2
    rows[0].ppl = math.nan  # never chosen
    assert cc.choose_within(rows, 9.0) == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvq.calibrate", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def readme_byom() -> list[list[str]]:
    """The README's three "Bring your own model" commands, split as the shell would."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- readme-byom[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    assert m, "README.md has no sh block after a readme-byom marker"
    lines = [shlex.split(line, comments=True) for line in m.group(1).strip().splitlines()]
    assert [line[:3] for line in lines] == [["kvq-calibrate-hf", "PATH/TO/CHECKPOINT", "--text"],
                                           ["build/bin/kvq", "models", "register"],
                                           ["python", "-c", lines[2][2]]], "the README's commands changed"
    return lines


def _substituted(argv: list[str], swap: dict[str, str]) -> list[str]:
    return [swap.get(a, a) for a in argv]


@pytest.fixture(scope="module")
def chosen_entry(smollm2_gguf, tmp_path_factory):
    """The README's calibration, short: 1024 calibration tokens, then 2 held-out windows of 384
    tokens (two encoded groups of 128 before the scored half ends), B = 3 and 2.5."""
    out = tmp_path_factory.mktemp("choice") / "my-model"
    calibrate = _substituted(readme_byom()[0], {"PATH/TO/CHECKPOINT": str(smollm2_gguf), "my-model": str(out),
                                                "YOUR_TEXT.txt": str(data_file("wikitext-2/wiki.valid.tokens"))})
    assert calibrate[-2:] == ["--out", str(out)] and "--model-name" in calibrate
    calibrate[calibrate.index("--model-name") + 1] = "my-model"
    r = _cli(*calibrate[1:], "--tokens", "1024", "--window-len", "256", "--batch", "2", "--threads", "1",
             "--bits", "3,2.5", "--search-windows", "2", "--search-window-len", "384", "--quiet")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_chooses_smollm2s_codec_within_the_budget(chosen_entry, smollm2_gguf, kvq_server, kvq_build_dir, tmp_path):
    text = str(data_file("wikitext-2/wiki.valid.tokens"))
    out, printed = chosen_entry
    search = json.loads((out / "codec-search.json").read_text())
    chosen = [c for c in search["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["name"] == search["chosen"] == printed["codec"]["chosen"]
    best = chosen[0]
    assert best["bits_per_element"] <= 3.0
    assert search["first_token"] == 1024 and search["windows"] == 2 and search["window_len"] == 384
    # The codec was applied: the candidates' perplexities differ, and each is finite.
    ppls = [c["ppl"] for c in search["candidates"] if "skipped" not in c]
    assert len(ppls) >= 5 and all(math.isfinite(p) for p in ppls) and len(set(ppls)) == len(ppls)
    # Every row over the largest budget was skipped; the 2.5-bit choice is within 2.5 bits.
    assert all(("skipped" in c) == (c["bits_per_element"] > 3.0) for c in search["candidates"])
    b25 = search["budgets"][1]
    assert b25["max_bits_per_element"] == 2.5 and b25["bits_per_element"] <= 2.5
    # The lever stages ran: the key levers, the oblique pair (fitted by --bits) among them; the
    # entry serves with the oblique pair exactly when the chosen row reads it.
    assert [c["name"] for c in search["key_lever_search"]["candidates"]] == \
        ["headq-kv2-g128", "headq-kv2-g128-mr", "headq-kv2-g128-obl-mr", "headq-kv2-g128-rotk-mr"]
    assert (out / "oblique" / "manifest.json").is_file()
    kind = json.loads((out / "manifest.json").read_text())["kind"]
    assert (kind == "oblique_rrr") == best["oblique_basis"] == (out / "query-pca").is_dir(), kind
    # codec.json holds the chosen settings, and the C++ reader takes them: `kvq models
    # register` reads the entry with core::ReadBasis + ReadCodecJson and sends the codec.
    codec = json.loads((out / "codec.json").read_text())
    assert codec == best["settings"]
    commands = readme_byom()
    swap = {"build/bin/kvq": str(kvq_build_dir / "bin/kvq"), "my-model": str(out),
            "localhost:50051": kvq_server.address}
    r = subprocess.run(_substituted(commands[1], swap), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    served = subprocess.run([sys.executable, "-c", commands[2][2].replace("localhost:50051", kvq_server.address)],
                            capture_output=True, text=True, timeout=60)
    assert served.returncode == 0 and 'model: "my-model"' in served.stdout, served.stderr
    with kvq.Client(kvq_server.address, deadline=10.0) as client:
        got = client.get_model("my-model")
    assert got.oblique == best["oblique_basis"]
    policy = {kvq_pb2.CodecSettings.VALUE_POLICY_UNIFORM: "uniform", kvq_pb2.CodecSettings.VALUE_POLICY_A2: "a2"}
    for key, value in codec.items():
        have = getattr(got.codec, key)
        if key == "value_policy":
            have = policy[int(have)]
        assert have == pytest.approx(value), key
    # An impossible budget: exit 2 naming --bits and the smallest candidate, before calibrating.
    r = _cli(str(smollm2_gguf), "--out", str(tmp_path / "e2"), "--text", text, "--tokens", "256", "--threads", "1",
             "--bits", "2", "--quiet")
    assert r.returncode == 2, r.stderr
    assert "--bits: 2.000: no codec candidate fits; the smallest, kivi-kv2-g128-vg64, costs 2.391" in r.stderr
    assert not (tmp_path / "e2").exists()
    r = _cli(str(smollm2_gguf), "--out", str(tmp_path / "e3"), "--bits", "3,x")
    assert r.returncode == 2 and "--bits: '3,x': must be positive numbers" in r.stderr


def test_in_process_evaluation_is_what_the_server_serves(chosen_entry, smollm2_gguf, kvq_server):
    """The search's in-process evaluation against the same forward pass attending through a
    kvq-server (kvq.hf.KvqCache, one token at a time), on one held-out window, with a codec that
    uses every part the assembly here handles (groups decoded then window rows in order, rotated
    keys, metric rounding, the fp16 sinks beside group 0). At 8 bits the two agree to their
    arithmetic (decoded K/V + SDPA here, the server's kernels there: 0.07% measured; kvq-eval's
    own decode and fused reads differ by 0.03%); at 2 bits that arithmetic flips roundings and
    one window moves by up to about 1.6%, as it does between any two forward passes."""
    from kvq.hf.calibration import load_checkpoint, read_tokens
    from kvq.hf.eval import decode_perplexity

    out, _ = chosen_entry
    torch.set_num_threads(1)
    _, tok, lm = load_checkpoint(str(smollm2_gguf), None, "float32", "cpu")
    ids = read_tokens(tok, str(data_file("wikitext-2/wiki.valid.tokens")), 1024 + 272)[1024:]
    codes = cc.entry_codes(str(out))
    settings, _ = cc.codec_of_name("kivi-kv8-g128-vg64-rotk-mr-sink4")
    ours = cc.codec_perplexity(lm, codes, codes.codec(settings), ids, 1, 272)
    with kvq.Client(kvq_server.address, deadline=60.0) as client:
        info = kvq.hf.register_basis(client, str(out), lm, check=False)
        kvq.hf.enable(lm)
        served = decode_perplexity(lm, client, info, ids, 1, 272, settings)["ppl"]
        kvq.hf.disable(lm)
    print(f"in-process {ours:.4f}, served {served:.4f} ({ours / served - 1:+.3%})")
    assert ours == pytest.approx(served, rel=3e-3)
    # Not vacuous: the window tells codecs apart by far more than that.
    two_bit, _ = cc.codec_of_name("kivi-kv2-g128")
    assert cc.codec_perplexity(lm, codes, codes.codec(two_bit), ids, 1, 272) > served * 1.05
