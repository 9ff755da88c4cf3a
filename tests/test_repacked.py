"""A GGUF's repacked weights are written once beside its converted folder and mapped by later
loads: the same logits bit for bit, and a damaged file (data, header, index, or a file beside
another GGUF) is never used and never fatal: the weights are repacked and the file rewritten."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import forkserve
import numpy as np
import pytest
import torch

from conftest import fresh_home
from kvcache.kernels.qweight import Q4_F16, Q4_KS, S8_F16, QWeight
from kvcache.models.repacked import VERSION, RepackStore, repack_store

# the reader's own path to a weight: the store's arrays, then a QWeight over them (models/weights.py)
ENTRIES = {"a": (Q4_F16, 32, 64), "b": (S8_F16, 16, 64), "c": (Q4_KS, 16, 256)}


def _loaded(store: RepackStore, key: str) -> list[np.ndarray | None] | None:
    """What a load takes from ``store`` for ``key`` (None: that weight is repacked from the GGUF)."""
    fmt, out, k = ENTRIES[key]
    found = store.get(key, fmt, out, k)
    if found is None:
        return None
    parts = QWeight(fmt, out, k, arrays=tuple(found)).seal().parts()  # type: ignore[arg-type]
    return [None if t is None else t.numpy().view(np.uint8).copy() for t in parts]


def _folder(tmp_path: Path) -> tuple[Path, Path, dict[str, list[np.ndarray | None]]]:
    """A converted folder beside a (stand-in) GGUF, with a store of three small weights written."""
    gguf, folder = tmp_path / "m.gguf", tmp_path / "m"
    gguf.write_bytes(b"GGUF" + bytes(60))
    folder.mkdir()
    (folder / "kvcache.json").write_text(json.dumps({"source": str(gguf.resolve()), "fingerprint": "ab" * 32}))
    rng = np.random.default_rng(0)
    clean: dict[str, list[np.ndarray | None]] = {}
    with repack_store(folder) as store:
        assert store is not None and not store.found
        for key, (fmt, out, k) in ENTRIES.items():
            qw = QWeight(fmt, out, k)
            for t in qw.parts():
                if t is not None:
                    t.numpy().view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, t.numpy().nbytes, dtype=np.uint8)
            store.put(key, fmt, out, k, list(qw.parts()))
            clean[key] = [None if t is None else t.numpy().view(np.uint8).copy() for t in qw.parts()]
    return gguf, folder, clean


def _same(got: list[np.ndarray | None] | None, want: list[np.ndarray | None]) -> bool:
    return got is not None and len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and np.array_equal(g, w))
        for g, w in zip(got, want))


def test_every_flipped_byte_of_the_header_and_index_is_refused_or_harmless(tmp_path):
    _, folder, clean = _folder(tmp_path)
    store = RepackStore(folder)
    assert all(_same(_loaded(store, key), clean[key]) for key in ENTRIES)  # the clean file is used
    path = store.path
    good = path.read_bytes()
    data = min(a["offset"] for e in store.found.values() for a in e["arrays"] if a is not None)
    del store
    wrong = []
    fd = os.open(path, os.O_RDWR)
    try:  # the header, the index and the padding before the first array, then a few bytes of data
        for i in [*range(data), *range(data, len(good), 997)]:
            os.pwrite(fd, bytes([good[i] ^ 1 << (i % 8)]), i)  # one bit flipped in place
            try:
                for key in ENTRIES:
                    got = _loaded(RepackStore(folder), key)
                    if got is not None and not _same(got, clean[key]):
                        wrong.append(f"byte {i}: {key} differs")
            except Exception as e:  # noqa: BLE001 - any exception is the failure under test
                wrong.append(f"byte {i}: {type(e).__name__}: {e}")
            os.pwrite(fd, good[i : i + 1], i)
    finally:
        os.close(fd)
    assert not wrong, f"{len(wrong)} flips used or raised: {wrong[:5]}"
    assert all(_same(_loaded(RepackStore(folder), key), clean[key]) for key in ENTRIES)  # restored


def test_a_file_beside_another_gguf_is_repacked_and_older_files_are_removed(tmp_path):
    gguf, folder, clean = _folder(tmp_path)
    st, body = gguf.stat(), gguf.read_bytes()

    def used() -> bool:
        store = RepackStore(folder)
        return all(_same(_loaded(store, key), clean[key]) for key in ENTRIES)

    assert used()
    gguf.write_bytes(body + b"\0")  # another file of another size
    assert not RepackStore(folder).found
    gguf.write_bytes(body)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert used()  # the same size and mtime: the same file
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # rewritten in place, same size
    assert not RepackStore(folder).found
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    info = json.loads((folder / "kvcache.json").read_text())
    (folder / "kvcache.json").write_text(json.dumps({**info, "fingerprint": "cd" * 32}))  # converted from another
    assert not RepackStore(folder).found
    old = folder / f"repacked-v{VERSION - 1}.kvq"
    old.write_bytes(b"KVQPACK\0" + bytes(100))
    with repack_store(folder) as store:  # a load repacks every weight and rewrites the file
        assert store is not None and not store.found
        for key, (fmt, out, k) in ENTRIES.items():
            qw = QWeight(fmt, out, k)
            for t, want in zip(qw.parts(), clean[key]):
                if t is not None:
                    t.numpy().view(np.uint8)[...] = want
            store.put(key, fmt, out, k, list(qw.parts()))
    assert used() and not old.exists()
    (folder / "kvcache.json").unlink()  # no known source: no file is used or written
    assert not RepackStore(folder).found


def _rewritten(path: Path, good: bytes, index: object, n: int | None = None) -> None:
    """``good`` with another index (or index length ``n``) and a CRC that checks out (the layout in
    models/repacked.py: magic, length, CRC-32 of the rest, index, arrays)."""
    text = json.dumps(index).encode()
    data = min(a["offset"] for e in json.loads(good[20 : good.index(b"\0", 20)])["entries"].values()
               for a in e["arrays"] if a is not None)
    assert len(text) + 20 <= data
    body = struct.pack("<Q", len(text) if n is None else n) + text + bytes(data - 20 - len(text)) + good[data:]
    crc = zlib.crc32(body[8:], zlib.crc32(good[:8] + body[:8]))
    path.write_bytes(good[:8] + body[:8] + struct.pack("<I", crc) + body[8:])


def test_a_file_whose_crc_checks_out_but_whose_index_does_not_is_repacked(tmp_path):
    _, folder, clean = _folder(tmp_path)
    path = RepackStore(folder).path
    good = path.read_bytes()
    index = json.loads(good[20 : good.index(b"\0", 20)])
    first = index["entries"]["a"]["arrays"][0]

    def edited(**change: object) -> dict:
        e = json.loads(json.dumps(index))
        e["entries"]["a"]["arrays"][0] = {**first, **change}
        return e

    g, nb, qb = first["shape"]
    cases = [edited(offset=10**30), edited(offset=first["offset"] + 1), edited(offset=-4096),
             edited(bytes=2**62, shape=[2**31, 2**31]), edited(shape=[10**12, 10**12, 10**12]),
             edited(shape=[g * nb, qb]), edited(shape=[qb, nb, g]), edited(dtype="float64"), edited(dtype=[1]),
             edited(shape="x"), edited(bytes=True), {**index, "version": VERSION - 1}, {**index, "source": None},
             {**index, "entries": []}, [], "x", {**index, "entries": {"a": {**index["entries"]["a"], "fmt": "1"}}},
             {**index, "entries": {"a": {**index["entries"]["a"], "arrays": [None] * 4}}}]
    tracemalloc.start()
    try:
        for case in [*cases, None]:
            if case is None:
                _rewritten(path, good, index, n=2**63)  # a length past the file's end
            else:
                _rewritten(path, good, case)
            store = RepackStore(folder)
            for key in ENTRIES:
                got = _loaded(store, key)
                assert got is None or _same(got, clean[key]), (case, key)
        for cut in (0, 10, 19, len(good) // 2):  # and cut short
            path.write_bytes(good[:cut])
            assert not RepackStore(folder).found
        assert tracemalloc.get_traced_memory()[1] < 64 << 20  # nothing was allocated by a size it read
    finally:
        tracemalloc.stop()
    _rewritten(path, good, index)  # the same edit of an unchanged index is used
    assert all(_same(_loaded(RepackStore(folder), key), clean[key]) for key in ENTRIES)


SCRIPT = """
import os, sys, torch
from pathlib import Path
from kvcache import LLM
from kvcache.models.repacked import file_name
out, steps, mode = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
kinds = []
for i, step in enumerate(steps):
    (folder,) = [p.parent for p in (out / "home" / "models").glob("*/kvcache.json")]
    if step != "none":  # one bit flipped (the file replaced: no mapping of the old one sees it)
        kvq = folder / file_name(mode)
        data = bytearray(kvq.read_bytes())
        text = bytes(data[:4096])
        at = {"head": 8, "offset": text.find(b'"offset": ', text.find(b'"offset": ') + 1) + 10,
              "shape": text.find(b'"shape": [') + 10}[step]
        while step == "offset" and chr(data[at + 1]).isdigit():  # the last digit of the second array's offset
            at += 1
        data[at] ^= 1
        kvq.with_suffix(".tmp").write_bytes(bytes(data))
        os.replace(kvq.with_suffix(".tmp"), kvq)
    llm = LLM(prefix=False, weights=mode)
    r = llm.runner
    torch.save(r.step([r.new_sequence()], [llm.encode("The history of the printing press begins")])[0],
               out / f"{i}.pt")
    at = llm.model.plan[0][0].qs.data_ptr()
    kind = "owned"
    for line in open("/proc/self/maps"):  # where the first projection's values live
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= at < hi and line.rstrip().endswith(".kvq"):
            kind = "mapped"
    kinds.append(kind)
    del llm, r
print(" ".join(kinds))
"""


@pytest.mark.parametrize("mode,steps", [("file", "none,offset,shape,head,none"), ("q8", "none,shape,none")])
def test_repacked_weights_are_mapped_by_later_loads_and_damage_is_repacked(tmp_path, mode, steps):
    """The file's own weights repacked, or (q8) its fp32 weights quantized anew, in the store of
    that mode: written by the first load, mapped by later ones, rebuilt where damaged; the stores
    of other modes and versions are left alone, this mode's older versions removed."""
    from kvcache.models.loading import resolve_model
    from kvcache.models.repacked import file_name
    from kvcache.paths import cache_home

    source = resolve_model(None).path  # the bundled model, converted once for the whole suite
    folder = tmp_path / "home" / Path(source).relative_to(cache_home())
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.kvq", ".*.tmp"))
    old = folder / file_name(mode).replace(f"v{VERSION}", f"v{VERSION - 1}")
    old.write_bytes(b"KVQPACK\0" + bytes(100))  # a file of an older layout: ignored, then removed
    others = [folder / file_name(m).replace(f"v{VERSION}", f"v{VERSION - 1}") for m in ("file", "q8") if m != mode]
    for other in others:
        other.write_bytes(b"KVQPACK\0" + bytes(100))
    steps = steps.split(",")
    env = {**os.environ, "KVCACHE_HOME": str(fresh_home(tmp_path / "home"))}
    r = subprocess.run(forkserve.python_command("-c", SCRIPT, str(tmp_path), ",".join(steps), mode),
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    kinds = r.stdout.split()[-len(steps):]
    # the first load repacks and writes the file; each damaged file is repacked
    # (the same logits) and rewritten, and the last load maps the rewritten file
    assert kinds == ["owned"] * (len(steps) - 1) + ["mapped"], kinds
    first = torch.load(tmp_path / "0.pt")
    for i, step in enumerate(steps[1:], 1):
        assert torch.equal(torch.load(tmp_path / f"{i}.pt"), first), f"{step}: other logits"
    assert RepackStore(folder, mode=mode).found and not old.exists()
    assert all(other.exists() for other in others)  # another mode's store is that mode's to replace
    assert [p.name for p in folder.glob(f"repacked-*v{VERSION}.kvq")] == [file_name(mode)]


def test_a_store_another_process_is_writing_is_repacked_once(tmp_path):
    """A load that must repack takes its turn on the store's lock: started while another process
    repacks the same file, it waits and maps that process's file instead of repacking beside it."""
    import time

    from kvcache.paths import one_at_a_time

    _, folder, _ = _folder(tmp_path)
    written = RepackStore(folder)
    entries = {key: (e["fmt"], e["out"], e["k"], written.get(key, e["fmt"], e["out"], e["k"]))
               for key, e in written.found.items()}
    held = {key: (f, o, k, [None if t is None else t.clone() for t in arrays]) for key, (f, o, k, arrays) in entries.items()}
    del written, entries
    path = folder / f"repacked-v{VERSION}.kvq"
    path.unlink()
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from kvcache.models.repacked import repack_store\n"
        "print('ready', flush=True)\n"
        "with repack_store(Path(sys.argv[1])) as store:\n"
        "    print(len(store.found), len(store.made))\n"), str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with one_at_a_time(path.with_name(f".{path.name}.lock")):
        assert child.stdout.readline() == "ready\n"
        time.sleep(1.0)  # time enough to find no file and start repacking, were it not waiting
        store = RepackStore(folder)
        for key, (fmt, out, k, arrays) in held.items():
            store.put(key, fmt, out, k, arrays)
        store.save()
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    assert out.split() == [str(len(ENTRIES)), "0"]  # found every weight this process wrote
    assert not list(folder.glob(".repacked-*.lock"))
