"""models/gguf_reader.py: gguf's reader over a plain view of the mapping reads what gguf's own reads
(every field's parts, types and indices, every tensor's place and bytes), and a damaged file fails
the same way."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from kvcache.models.gguf_reader import TruncatedGGUF, _reader_class, gguf_reader


def _write(path: Path) -> Path:
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("reader test")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list([f"tok{i}" + "é" * (i % 3) for i in range(3000)])  # lengths of 1 to 12 bytes
    w.add_token_scores([float(i) / 7 for i in range(3000)])
    w.add_token_types([i % 6 for i in range(3000)])
    w.add_token_merges([f"t{i} k{i}" for i in range(500)])
    w.add_array("llama.attention.head_count", [4, 4])
    w.add_tensor("token_embd.weight", rng.standard_normal((3000, 64)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((96, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_plain_view_reader_is_used_here():
    assert _reader_class() is not gguf.GGUFReader  # this gguf's slicing method is the one it overrides


def test_every_field_and_tensor_as_gguf_reads_them(tmp_path):
    path = _write(tmp_path / "m.gguf")
    theirs, ours = gguf.GGUFReader(str(path), "r"), gguf_reader(path)
    assert list(ours.fields) == list(theirs.fields) and len(theirs.fields["tokenizer.ggml.tokens"].data) == 3000
    for name, a in theirs.fields.items():
        b = ours.fields[name]
        assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), name
        assert len(b.parts) == len(a.parts), name
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
        assert b.contents() == a.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] and len(ours.tensors) == 3
    for a, b in zip(theirs.tensors, ours.tensors):
        assert (b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset) == \
               (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset), a.name
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape
        assert np.asarray(b.data).tobytes() == np.asarray(a.data).tobytes(), a.name
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment


@pytest.mark.parametrize("frac", [0.01, 0.3])
def test_a_cut_file_is_refused_in_our_words_where_gguf_refuses_it(tmp_path, frac):
    data = _write(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    size = int(len(data) * frac)
    cut.write_bytes(data[:size])
    with pytest.raises(Exception):
        gguf.GGUFReader(str(cut), "r")
    with pytest.raises(TruncatedGGUF, match=f"it holds {size:,} bytes, and its contents run to byte"):
        gguf_reader(cut)
