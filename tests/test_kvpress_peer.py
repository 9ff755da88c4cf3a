"""kvpress as a peer in a child process: a missing, crashing or garbled peer is a skipped row with its
reason; where ``make kvpress`` built .venv-kvpress, kvpress and kvcache measure the same press on
the same token ids and agree."""

from __future__ import annotations

import sys
import textwrap

import pytest

from kvcache.peers.kvpress_peer import find_python, run_kvpress

CASES = [{"press": "knorm", "ratio": 0.5}, {"press": "snapkv", "ratio": 0.5}]


def _script(tmp_path, body: str):
    p = tmp_path / "peer.py"
    p.write_text(textwrap.dedent(body))
    return p


def test_missing_peer_gives_skipped_rows(tmp_path):
    run = run_kvpress(tmp_path, CASES, [1, 2, 3], [4, 5, 6], python=tmp_path / "no-venv" / "bin" / "python")
    assert [r.press for r in run.rows] == ["knorm", "snapkv"]
    assert all("kvpress is not installed" in r.skipped and "make kvpress" in r.skipped for r in run.rows)


def test_unknown_press_gives_skipped_rows(tmp_path):
    run = run_kvpress(tmp_path, [{"press": "pyramid", "ratio": 0.5}], [1, 2], [3, 4], python=sys.executable)
    assert "no counterpart of press 'pyramid'" in run.rows[0].skipped


@pytest.mark.parametrize("body, reason", [
    ("import os, signal, sys; sys.stdin.read(); os.kill(os.getpid(), signal.SIGSEGV)", "died of signal 11"),
    ("import sys; sys.stdin.read(); print('Traceback...', file=sys.stderr); "
     "print('ImportError: no kvpress here', file=sys.stderr); sys.exit(1)", "failed (exit 1): ImportError: no kvpress here"),
    ("import sys; sys.stdin.read(); print('not json')", "answer could not be read"),
    ("import json, sys; sys.stdin.read(); print(json.dumps({'results': []}))", "answer could not be read"),
    ("import time; time.sleep(30)", "did not answer within 2 s"),
])
def test_crashing_peer_gives_skipped_rows(tmp_path, body, reason):
    run = run_kvpress(tmp_path, CASES, [1, 2, 3], [4, 5, 6], python=sys.executable,
                      script=_script(tmp_path, body), timeout=2)
    assert len(run.rows) == 2 and all(reason in r.skipped for r in run.rows), run.rows
    assert run.note


def test_one_failing_press_is_its_own_skipped_row(tmp_path):
    body = """
    import json, sys
    req = json.load(sys.stdin)
    res = [{"press": c["press"], "error": "AssertionError: boom"} if c["press"] == "snapkv" else
           {"press": c["press"], "nll": [1.0, 2.0], "kl": [0.1, 0.3], "agree": [1, 0], "kept": 2, "passkey": []}
           for c in req["cases"]]
    print(json.dumps({"versions": {"kvpress": "x"}, "reference": {"nll": [1.0, 1.0], "passkey": []}, "results": res}))
    """
    run = run_kvpress(tmp_path, CASES, [1, 2, 3], [4, 5, 6], python=sys.executable, script=_script(tmp_path, body))
    ok, bad = run.rows
    assert not ok.skipped and ok.mean_kl == pytest.approx(0.2) and ok.agreement == 0.5 and ok.kept == 2
    assert bad.skipped == "kvpress: AssertionError: boom"


needs_kvpress = pytest.mark.skipif(find_python() is None, reason="no .venv-kvpress (make kvpress)")


@needs_kvpress
def test_kvpress_and_kvcache_measure_the_same_press_alike(smollm):
    from kvcache.eval.continuation import measure, reference, split
    from kvcache.eval.fidelity import builtin_text
    from kvcache.eval.passkey import passkey_cases
    from kvcache.models.loading import fp32_folder

    context, cont = split(smollm.encode(builtin_text())[:160], 32)
    keys = passkey_cases(smollm.tokenizer, 150, (0.5,))
    run = run_kvpress(fp32_folder(None), [{"press": "knorm", "ratio": 0.5}], context, cont,
                      [(c, q) for c, q, _ in keys], eos=smollm.tokenizer.eos_token_ids, threads=1)
    assert not run.note, run.note
    assert run.versions["kvpress"] == "0.5.5"
    ref = reference(smollm.model, context, cont)
    # the same model in transformers and in kvcache: the uncompressed figures agree to fp32 noise
    assert [round(x, 3) for x in run.reference_nll] == [round(float(x), 3) for x in ref.nll]
    assert str(keys[0][2]) in smollm.tokenizer.decode(list(run.reference_answers[0]))
    row = run.rows[0]
    assert row.kept == int(len(context) * 0.5)  # kvpress keeps int(n * (1 - ratio)) per head
    assert row.mean_kl > 1e-4 and len(row.kl) == len(cont) - 1
    mine = measure(smollm.model, ref, "press=knorm,ratio=0.5,protect=0")
    # the same rule on the same keys: within the noise of the measurement (a few standard errors)
    assert abs(mine.kl - row.mean_kl) <= 3 * max(mine.kl_se, 1e-4), (mine, row.mean_kl)
