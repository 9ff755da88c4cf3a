"""``kvcache bench attention``: rows for every context and encoding, the bytes each call reads,
and clear refusals."""

from __future__ import annotations

import argparse
import json

import pytest

from kvcache import kernels
from kvcache.bench import attention
from kvcache.errors import InvalidParams


def test_rows_bytes_and_shares(tmp_path, capsys, monkeypatch):
    if kernels.qattn() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(attention, "ROUND", 1 << 20)  # small copies and probe: the arithmetic is what is tested
    monkeypatch.setattr(attention, "WALL_FLOATS", 1 << 20)
    out = tmp_path / "a.json"
    args = argparse.Namespace(threads=None, contexts="64,96", kv="int4,rotate,fp16", peers=None, repeats=1,
                              json=str(out))
    assert attention.run(args) == 0
    data = json.loads(out.read_text())
    rows = {(r["context"], r["kv"]): r for r in data["rows"]}
    assert set(rows) == {(64, "int4,rotate"), (64, "fp16"), (96, "int4,rotate"), (96, "fp16")}
    # per token and KV head: int4 codes of K and V (32 + 32 bytes), a half scale and minimum per
    # channel per 32 keys (8 bytes), a half scale and minimum per 32 channels of a value (8 bytes)
    assert rows[(64, "int4,rotate")]["bytes_layer"] == 64 * 8 * (32 + 32 + 8 + 8)
    assert rows[(96, "fp16")]["bytes_layer"] == 96 * 8 * 64 * 2 * 2
    for r in rows.values():
        assert r["ms_token"] == pytest.approx(16 * r["ms_layer"])
        assert r["gb_s"] == pytest.approx(r["bytes_layer"] / r["ms_layer"] / 1e6)
        assert r["vs_torch"] == pytest.approx(r["torch_ms_layer"] / r["ms_layer"])
        if data["read_wall_gb_s"]:
            assert r["share_of_wall"] == pytest.approx(r["gb_s"] / data["read_wall_gb_s"])
    assert "64 int4,rotate" in capsys.readouterr().out.replace("  ", " ")


@pytest.mark.parametrize("kv,contexts,message", [("rotate", "64", "rotate follows"), ("fp32", "64", "not an encoding"),
                                                 ("int8", "100", "multiple of 32")])
def test_bad_input_is_named(kv, contexts, message):
    args = argparse.Namespace(threads=None, contexts=contexts, kv=kv, peers="", repeats=1, json=None)
    with pytest.raises(InvalidParams, match=message):
        attention.run(args)


def test_rows_time_a_prefill_chunk_without_the_decode_peer(tmp_path, capsys, monkeypatch):
    if kernels.qattn() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(attention, "ROUND", 1 << 20)
    monkeypatch.setattr(attention, "WALL_FLOATS", 1 << 20)
    out = tmp_path / "a.json"
    args = argparse.Namespace(threads=None, contexts="64", kv="int8,fp16", peers=None, repeats=1, json=str(out),
                              rows=40)
    assert attention.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kv"], r["rows"]) for r in rows] == [("int8", 40), ("fp16", 40)]
    assert rows[1]["bytes_layer"] == 64 * 8 * 64 * 2 * 2  # the context's pages, as a quantized row counts them
    for r in rows:  # 40 rows of 32 query heads (64 channels) over 64 keys and the rows before them
        macs = 40 * 32 * 64 * 2 * (64 + 41 / 2)
        assert r["gflop_s"] == pytest.approx(2 * macs / r["ms_layer"] / 1e6) and r["torch_ms_layer"] is None
    assert "for 40 new rows" in capsys.readouterr().out
    assert attention.headline(json.loads(out.read_text())) == []  # no peer to stand beside
    args.peers = "torch"
    with pytest.raises(InvalidParams, match="--peers ''"):
        attention.run(args)
    args.peers, args.rows = "", -1
    with pytest.raises(InvalidParams, match="--rows"):
        attention.run(args)
