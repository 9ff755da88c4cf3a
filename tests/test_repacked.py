"""A GGUF's repacked weights are written once beside its converted folder and mapped by later
loads: the same logits bit for bit, and a damaged file is never used (repacked again, rewritten)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvcache.models.repacked import VERSION, RepackStore

SCRIPT = """
import sys, time, torch
from kvcache import LLM
t = time.perf_counter()
llm = LLM(prefix=False)
took = time.perf_counter() - t
ids = llm.encode("The history of the printing press begins")
r = llm.runner
s = r.new_sequence()
torch.save(r.step([s], [ids])[0], sys.argv[1])
at = llm.model.plan[0][0].qs.data_ptr()
kind = "owned"
for line in open("/proc/self/maps"):  # where the first projection's values live
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if lo <= at < hi and line.rstrip().endswith(".kvq"):
        kind = "mapped"
print(kind, took)
"""


def _load(home: Path, out: Path) -> tuple[str, float]:
    env = {**os.environ, "KVCACHE_HOME": str(home)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    kind, took = r.stdout.split()
    return kind, float(took)


def _store(home: Path) -> Path:
    (found,) = list((home / "models").glob(f"*/repacked-v{VERSION}.kvq"))
    return found


def test_repacked_weights_are_mapped_by_later_loads_and_damage_is_refused(tmp_path):
    import torch

    first, _ = _load(tmp_path, tmp_path / "a.pt")
    store = _store(tmp_path)
    assert first == "owned" and RepackStore(store.parent).found  # written by the first load, valid
    again, _ = _load(tmp_path, tmp_path / "b.pt")
    assert again == "mapped"  # the weights are views of the mapped file
    assert torch.equal(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"))
    good = store.read_bytes()
    for damage in ("truncate", "magic", "flip"):  # each refused by the check alone (CRC, size, magic)
        data = bytearray(good)
        if damage == "flip":
            data[-100] ^= 0x10
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data[0] ^= 0xFF
        store.write_bytes(bytes(data))
        assert not RepackStore(store.parent).found
    kind, _ = _load(tmp_path, tmp_path / "c.pt")  # the last damage (a flipped bit) in place at load
    assert kind == "owned"  # repacked from the GGUF instead
    assert torch.equal(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "c.pt"))
    assert RepackStore(store.parent).found  # and the file rewritten whole
