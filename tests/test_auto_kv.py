"""The quality gate (``kvcache eval --auto``, ``--kv auto``) on the real bundled SmolLM2: it picks the
cheapest measured candidate within the budget, saves and reloads the choice beside the model's
fingerprint, refuses a bad budget in one line, and its choice keeps the KL budget on text it was
not calibrated on."""

from __future__ import annotations

import argparse
import json

import pytest

from kvcache.errors import InvalidParams, KVCacheError
from kvcache.eval import auto
from kvcache.eval.auto import Budget, choose, parse_auto
from kvcache.eval.cli_auto import calibrate, resolve_auto
from kvcache.eval.continuation import measure, reference, split
from kvcache.eval.fidelity import builtin_text

TOKENS, CONT = 192, 40
# a short residual, so that the short context is mostly quantized (the default 128 tokens would
# keep all of it in fp32)
SPECS = ["int8,residual=32", "int4,residual=32", "int2,residual=32", "sinks=4,window=64"]
if auto.presses_available():
    SPECS += ["int4,residual=32,press=knorm,ratio=0.5,protect=16"]


@pytest.fixture(scope="module")
def calibrated(smollm, tmp_path_factory):
    """One calibration on the start of the built-in text, saved under a private KVCACHE_HOME."""
    home = tmp_path_factory.mktemp("kvhome")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVCACHE_HOME", str(home))
    budget = Budget(max_kl=0.05, min_agree=0.9)
    data, row = calibrate(smollm, builtin_text(), "pydoc_data.topics", budget, TOKENS, CONT, SPECS)
    yield data, row, budget
    mp.undo()


def _cheapest_admitted(rows, budget):
    best = None
    for r in rows:
        if "error" in r or r["kl"] + budget.margin * r["kl_se"] > budget.max_kl or r["agreement"] < budget.min_agree:
            continue
        if best is None or (r["bytes_per_token"], r["kl"]) < (best["bytes_per_token"], best["kl"]):
            best = r
    return best


def test_choice_is_the_cheapest_measured_row_within_budget(calibrated):
    data, row, budget = calibrated
    table = data["table"]
    assert len(table) == len(SPECS) + 1 and table[0]["spec"] == "dynamic"  # the full cache is always measured
    assert table[0]["kl"] == pytest.approx(0, abs=1e-6) and table[0]["agreement"] == 1.0
    assert not [r for r in table if "error" in r], table
    assert row["spec"] == _cheapest_admitted(table, budget)["spec"]
    assert row["spec"] != "dynamic"  # something compresses within 0.05 nats (int8 at least)
    for r in table:  # every cheaper row is over the budget
        if r["bytes_per_token"] < row["bytes_per_token"]:
            assert not budget.admits(r), r
    # a budget between two measured rows moves the choice as the table says
    bounds = sorted({r["kl"] + 2 * r["kl_se"] for r in table if r["agreement"] >= 0.5} - {0.0})
    assert len(bounds) >= 2
    for b in bounds:
        tight = Budget(max_kl=b * 1.0001, min_agree=0.5)
        assert choose(table, tight)["spec"] == _cheapest_admitted(table, tight)["spec"]


def test_saved_beside_the_fingerprint_and_reloaded_without_measuring(calibrated, smollm, monkeypatch):
    data, row, budget = calibrated
    from kvcache.models.loading import model_fingerprint, resolve_model

    fp = model_fingerprint(resolve_model(None).path)
    path = auto.store_path(fp)
    saved = json.loads(path.read_text())
    assert saved["fingerprint"] == fp and saved["choices"][budget.key]["spec"] == row["spec"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"

    def no_measuring(*a, **k):
        raise AssertionError("--kv auto measured again although a choice was saved")

    monkeypatch.setattr(auto, "measure_table", no_measuring)
    assert resolve_auto("auto", None) == row["spec"]
    assert resolve_auto(f"auto,kl={budget.max_kl}", None) == row["spec"]
    # a new budget is picked from the saved table, and remembered
    loose = Budget(max_kl=0.5, min_agree=0.5)
    spec = resolve_auto("auto,kl=0.5,agree=0.5", None)
    assert spec == _cheapest_admitted(data["table"], loose)["spec"]
    assert auto.load(fp)["choices"][loose.key]["spec"] == spec
    # what generate, chat and serve build from --kv auto
    from kvcache.cliargs import kv_config

    args = argparse.Namespace(kv="auto,kl=0.5,agree=0.5", model=None, weights="fp32", threads=None, kv_budget=None)
    assert kv_config(args).spec() == spec


def test_generate_with_kv_auto_uses_the_saved_choice(calibrated, capsys):
    _, row, _ = calibrated
    from kvcache.cli import main

    assert main(["generate", "--kv", "auto,kl=0.05", "--weights", "fp32", "-n", "4", "The sky is"]) == 0
    err = capsys.readouterr().err
    assert f"kv={row['spec']}" in err and "measuring" not in err


@pytest.mark.parametrize("argv, message", [
    (["--max-kl", "0"], "KL budget must be a number of nats above 0"),
    (["--max-kl", "nan"], "KL budget must be a number of nats above 0"),
    (["--min-agree", "1.5"], "top-1 agreement budget must be between 0 and 1"),
    (["--margin", "-1"], "margin must be 0 or more"),
])
def test_bad_budget_is_one_line(argv, message, capsys):
    from kvcache.cli import main

    assert main(["eval", "--auto", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_bad_auto_spec_is_refused():
    for spec, message in [("auto,kl=abc", "takes a number"), ("auto,int4", "kl=X, agree=Y and margin=Z only"),
                          ("auto,kl=-2", "above 0")]:
        with pytest.raises(InvalidParams, match=message):
            parse_auto(spec)
    assert parse_auto("auto") is None
    assert parse_auto("auto,kl=0.1,agree=0.8").key == "kl=0.1,agree=0.8,margin=2"
    with pytest.raises(KVCacheError, match="no candidate meets"):
        choose([{"spec": "x", "kl": 1.0, "kl_se": 0.0, "agreement": 1.0, "bytes_per_token": 1.0}], Budget(0.1))


def test_choice_keeps_its_budget_on_held_back_text(calibrated, smollm):
    data, row, budget = calibrated
    ids = smollm.encode(builtin_text())
    for start in (40000,):  # other documentation topics than the calibration's
        context, cont = split(ids[start : start + TOKENS], CONT)
        held = measure(smollm.model, reference(smollm.model, context, cont), row["spec"])
        assert held.kl <= budget.max_kl, (row["spec"], held)
        assert held.agreement >= budget.min_agree, (row["spec"], held)
