"""Rotated low-bit KV (``--kv int4,rotate``): the normalized Hadamard transform, the spec, the pool
(rotated codes, unrotated reads), fidelity on the bundled SmolLM2 against the unrotated encodings,
composition with every axis (tests/test_cache_matrix.py's checks on rotated specs, rollback as
tests/test_rollback.py checks it, presses, windows, sliding layers), and identity: prefix hits,
tier entries and saved files of a rotated cache never meet an unrotated one's."""

from __future__ import annotations

import itertools
import pydoc_data.topics

import pytest
import torch
from test_cache_matrix import CAPACITY, PLACEMENT, VISIBILITY, recompute, references, tiny_llm  # noqa: F401
from test_cache_matrix import test_combination as check_combination
from test_rollback import _run as rollback_run
from test_rollback import made  # noqa: F401

from kvcache import LLM, PrefixConfig, SamplingParams
from kvcache.cache import quant
from kvcache.cache.config import parse_kv_spec
from kvcache.cache.qpool import QuantPool
from kvcache.cache.rotation import block_size, hadamard, sylvester
from kvcache.cache.sequence import HOLE
from kvcache.engine.runner import ModelRunner
from kvcache.errors import InvalidParams, KVCacheError
from kvcache.eval.fidelity import compare

TEXT = " ".join(list(pydoc_data.topics.topics.values())[:6])


# -- the transform ---------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 16, 64, 80, 96, 256])
def test_hadamard_equals_sylvesters_matrix_per_block(d):
    x = torch.randn(3, 5, d)
    b = block_size(d)
    want = (x.double().reshape(3, 5, d // b, b) @ sylvester(b)).reshape(3, 5, d)
    assert float((hadamard(x) - want).abs().max()) < 1e-6


def test_hadamard_is_its_own_inverse_keeps_norms_and_spreads_an_outlier():
    x = torch.randn(2, 3, 40, 64)
    assert float((hadamard(hadamard(x)) - x).abs().max()) < 1e-6
    torch.testing.assert_close(hadamard(x).norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-6)
    spike = torch.zeros(64)
    spike[7] = 8.0
    assert torch.allclose(hadamard(spike).abs(), torch.full((64,), 1.0))  # one channel over all 64
    view = torch.randn(4, 64, 2).transpose(1, 2)  # strides and dtype of the input do not matter
    assert torch.equal(hadamard(view), hadamard(view.contiguous()))
    assert hadamard(view.half()).dtype == torch.float32


def test_block_size_is_the_largest_power_of_two_dividing():
    assert [block_size(d) for d in (64, 80, 96, 128, 200, 7)] == [64, 16, 32, 128, 8, 1]
    with pytest.raises(ValueError):
        sylvester(12)


# -- the spec --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,canonical", [("int4,rotate", "dynamic,int4,rotate"),
                                            ("static,int2,rotate,residual=0", "static,int2,residual=0,rotate"),
                                            ("rotate,quantized,host", "dynamic,int4,rotate,host")])
def test_spec_takes_rotate_and_round_trips(spec, canonical):
    cfg = parse_kv_spec(spec)
    assert cfg.rotate and cfg.spec() == canonical and parse_kv_spec(cfg.spec()) == cfg
    assert not parse_kv_spec("int4").rotate and "rotate" not in parse_kv_spec("int4").spec()


@pytest.mark.parametrize("spec", ["rotate", "fp16,rotate", "bf16,rotate", "static,fp32,rotate"])
def test_rotate_without_a_quantized_encoding_is_refused_naming_what_works(spec):
    with pytest.raises(InvalidParams) as e:
        parse_kv_spec(spec)
    assert "int8, int4, int2" in str(e.value) and "\n" not in str(e.value)


def test_rotate_takes_no_value():
    with pytest.raises(InvalidParams, match="takes no value"):
        parse_kv_spec("int4,rotate=1")


# -- the pool --------------------------------------------------------------------------------------
def _outliers(n: int) -> torch.Tensor:
    """[2, 2, n, 64]: K and V of 2 heads, channel 5 ten times the others (as real keys have)."""
    kv = torch.randn(2, 2, n, 64)
    kv[:, :, :, 5] *= 10
    return kv


@pytest.mark.parametrize("bits", quant.BITS)
def test_pool_holds_rotated_codes_and_reads_back_unrotated(bits):
    kv = _outliers(64)
    err = {}
    for rotate in (False, True):
        pool = QuantPool(1, 2, 64, 32, 4, bits, 32, rotate=rotate)
        pool.write_pages(0, torch.tensor([2, 0]), kv)
        out = torch.full_like(kv, float("nan"))
        pool.read_into(0, torch.tensor([2, 0]), 0, 2, out)
        err[rotate] = float((out - kv).pow(2).mean())
        if rotate:  # the codes are those of the rotated K/V: read as unrotated codes, they give H(kv)
            plain = QuantPool(1, 2, 64, 32, 4, bits, 32)
            plain.load_pages(0, [0, 1], pool.page_state(0, [2, 0]))
            raw = torch.empty_like(kv)
            plain.read_into(0, None, 0, 2, raw)
            torch.testing.assert_close(hadamard(raw), out, atol=1e-5, rtol=1e-5)
            assert float((raw - kv).abs().max()) > 1.0
    assert err[True] < err[False]  # the outlier channel no longer sets the values' ranges


# -- fidelity on the bundled SmolLM2 ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ids(smollm):
    return smollm.encode(TEXT)[:320]


@pytest.fixture(scope="module")
def decoded(smollm, ids):
    """decoded(spec) -> logits [17, V]: after a 256-token prompt, then after each of 16 forced tokens,
    one at a time (lone decode queries: the path a native quantized decode kernel takes). Each spec
    is run once per module."""
    done: dict[str, torch.Tensor] = {}

    def get(spec: str) -> torch.Tensor:
        if spec not in done:
            runner = ModelRunner(smollm.model, parse_kv_spec(spec))
            seq = runner.new_sequence()
            out = [runner.step([seq], [ids[:256]])[0]] + [runner.step([seq], [[t]])[0] for t in ids[256:272]]
            runner.free(seq)
            runner.check_integrity()
            done[spec] = torch.stack(out)
        return done[spec]

    return get


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean KL(ref || got) of the rows' next-token distributions, nats. ref, got: [N, V] logits."""
    a, b = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return float((a.exp() * (a - b)).sum(-1).mean())


def test_rotated_int4_and_int2_are_closer_to_fp32_than_unrotated(decoded):
    """No fp32 window: every sealed page quantized. Rotation lowers the KL against the full cache
    (measured: int4 0.0068 -> 0.0031 nats, int2 0.198 -> 0.131). Codes read as if unrotated would be
    far off, so this also checks that every read of a rotated page is rotated back."""
    ref = decoded("dynamic")
    kl = {s: _kl(ref, decoded(s)) for s in ("int4,residual=0", "int4,rotate,residual=0", "int2,residual=0",
                                            "int2,rotate,residual=0")}
    assert kl["int4,rotate,residual=0"] < 0.7 * kl["int4,residual=0"]
    assert kl["int2,rotate,residual=0"] < 0.8 * kl["int2,residual=0"]
    assert int((decoded("int4,rotate,residual=0").argmax(-1) == ref.argmax(-1)).sum()) >= 16


@pytest.mark.parametrize("spec", ["static,int4,rotate,residual=0,max_tokens=512", "offloaded,int4,rotate,residual=0",
                                  "int4,rotate,residual=0,disk", "int4,rotate,residual=0,page_size=64"])
def test_capacity_and_placement_keep_the_rotated_bits(decoded, spec, tmp_path):
    want = decoded("int4,rotate,residual=0")
    got = decoded(spec + (f",dir={tmp_path}" if "disk" in spec else ""))
    if "page_size=64" in spec:  # larger pages seal later: close, not the same bits
        assert _kl(want, got) < 0.01
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("fp32,spec", [("sinks=4,window=128", "int4,rotate,residual=0,sinks=4,window=128"),
                                       ("window=128", "int4,rotate,residual=0,window=128"),
                                       ("press=snapkv,ratio=0.5", "int4,rotate,press=snapkv,ratio=0.5"),
                                       ("press=h2o,ratio=0.3", "int8,rotate,press=h2o,ratio=0.3")])
def test_rotation_composes_with_windows_sinks_and_presses(decoded, fp32, spec):
    """Against the same visibility or press over fp32 pages: the rotated encoding adds its small error only."""
    assert _kl(decoded(fp32), decoded(spec)) < 0.05


# -- composition on the tiny model: tests/test_cache_matrix.py's checks, rotated ------------------
ROTATED = ["int4,rotate,group_size=8,residual=4"]
MATRIX = [",".join(x for x in combo if x) for combo in itertools.product(CAPACITY, VISIBILITY, ROTATED, PLACEMENT)]
MATRIX += ["int8,rotate,group_size=8,residual=4", "int2,rotate,group_size=8,residual=4,sinks=2,window=8"]


@pytest.mark.parametrize("spec", MATRIX)
def test_rotated_combination(tiny_llm, recompute, references, spec, tmp_path):  # noqa: F811
    check_combination(tiny_llm, recompute, references, spec, tmp_path)


@pytest.mark.parametrize("kv", ["int4,rotate,residual=8", "int2,rotate,residual=32", "int4,rotate,press=snapkv,ratio=0.5",
                                "int8,rotate,window=96,page_size=32"])
def test_rollback_of_rotated_caches(made, kv):  # noqa: F811
    want, _ = rollback_run(made(kv), verify=False)
    got, _ = rollback_run(made(kv), verify=True)
    assert got == want


# -- identity: prefix hits, tier entries and saved files -------------------------------------------
QSPEC = "int4,page_size=8,group_size=8,residual=0"
RSPEC = QSPEC + ",rotate"
LONG = [(i * 7 + 3) % 97 + 5 for i in range(44)]  # 5 whole pages of 8, 4 tokens left in fp32
PROMPT = LONG[:-1] + [7]


def _steps(llm: LLM, parts: list[list[int]]) -> torch.Tensor:
    """A fresh sequence (no prefix lookup) reading ``parts`` one forward each: the last logits."""
    seq = llm.runner.new_sequence()
    for p in parts:
        logits = llm.runner.step([seq], [p])[0]
    llm.runner.free(seq)
    return logits


def _write(path: str, spec: str, disk) -> LLM:
    """An LLM with a disk tier that has read LONG, its pages written through to the tier."""
    llm = LLM(path, kv=spec, prefix=PrefixConfig(disk=str(disk)))
    seq = llm.runner.lookup(LONG)
    llm.runner.step([seq], [LONG])
    llm.runner.release(seq)
    llm.flush()
    return llm


def test_rotated_prefix_hit_equals_recomputing_with_the_same_rotated_spec(tiny_dir):
    path = str(tiny_dir("llama")[0])
    llm = LLM(path, kv=RSPEC)
    seq = llm.runner.lookup(LONG)
    llm.runner.step([seq], [LONG])
    llm.runner.release(seq)
    seq = llm.runner.lookup(PROMPT)
    assert len(seq.tokens) == 40  # the sealed (rotated) pages are shared
    got = llm.runner.step([seq], [PROMPT[40:]])[0]
    llm.runner.release(seq)
    llm.check_integrity()
    fresh = LLM(path, kv=RSPEC, prefix=False)
    torch.testing.assert_close(got, _steps(fresh, [PROMPT[:40], PROMPT[40:]]), atol=1e-6, rtol=1e-6)
    plain = _steps(LLM(path, kv=QSPEC, prefix=False), [PROMPT[:40], PROMPT[40:]])
    assert not torch.equal(got, plain)  # the rotation did change what the pages hold


@pytest.mark.parametrize("writer,reader", [(QSPEC, RSPEC), (RSPEC, QSPEC)])
def test_a_tier_entry_of_one_rotation_is_a_miss_for_the_other(tiny_dir, tmp_path, writer, reader):
    path = str(tiny_dir("llama")[0])
    first = _write(path, writer, tmp_path)
    later = LLM(path, kv=reader, prefix=PrefixConfig(disk=str(tmp_path)))
    seq = later.runner.lookup(PROMPT)
    assert len(seq.tokens) == 0 and later.prefix_stats().tier_tokens == 0
    later.runner.release(seq)
    same = LLM(path, kv=writer, prefix=PrefixConfig(disk=str(tmp_path)))  # the writer's own spec hits
    seq = same.runner.lookup(PROMPT)
    assert len(seq.tokens) == 40 and same.prefix_stats().tier_tokens == 40
    got = same.runner.step([seq], [PROMPT[40:]])[0]
    mine = first.runner.lookup(PROMPT)  # the very pages, in the writing cache's RAM
    torch.testing.assert_close(got, first.runner.step([mine], [PROMPT[40:]])[0], atol=1e-6, rtol=1e-6)
    for llm, s in ((same, seq), (first, mine)):
        llm.runner.release(s)
        llm.check_integrity()


def test_unrotated_tier_keys_are_unchanged(tiny_dir):
    from kvcache.prefix.restore import layout_text

    path = str(tiny_dir("llama")[0])
    plain = layout_text(LLM(path, kv=QSPEC, prefix=False).runner.cache)
    assert "rotate" not in plain
    assert layout_text(LLM(path, kv=RSPEC, prefix=False).runner.cache) != plain


@pytest.mark.parametrize("writer,reader", [(QSPEC, RSPEC), (RSPEC, QSPEC)])
def test_a_saved_file_of_one_rotation_is_refused_by_the_other(tiny_dir, tmp_path, writer, reader):
    path = str(tiny_dir("llama")[0])
    saver = LLM(path, kv=writer, prefix=False)
    file = str(tmp_path / "p.kv")
    saver.save_cache(file, LONG)
    other = LLM(path, kv=reader, prefix=False)
    with pytest.raises(KVCacheError, match="rotate"):
        other.runner.load(file, other.fingerprint)
    other.check_integrity()
    assert other.kv_stats().pages_in_use == 0
    seq = saver.runner.load(file, saver.fingerprint)  # its own spec loads it: the next step as one pass
    got = saver.runner.step([seq], [[7]])[0]
    saver.runner.free(seq)
    torch.testing.assert_close(got, _steps(saver, [LONG, [7]]), atol=1e-6, rtol=1e-6)


@pytest.mark.gemma
def test_gemma3_sliding_layers_with_rotated_int4():
    """Gemma 3 270M (head_dim 256, sliding layers of 512 tokens) read past its window in chunks of
    64 with no fp32 window: rotated int4 stays near the fp32 cache and its sliding layers give pages
    back. (On this model rotation costs int4 KL rather than saving it: EVAL.md.)"""
    from conftest import gemma_installed

    if not gemma_installed():
        pytest.skip("the Gemma 3 270M package is not installed (make gemma)")
    llm = LLM("gemma3-270m", prefix=False)
    ids = llm.encode(TEXT)[:640]
    f = compare(llm.model, ids, "int4,rotate,residual=0", chunk=64)
    assert f.kl < 0.05 and f.agreement > 0.9
    runner = ModelRunner(llm.model, parse_kv_spec("int4,rotate,residual=0"))
    seq = runner.new_sequence()
    runner.step([seq], [ids[:600]])
    for t in ids[600:604]:  # decoding: pages that left the window go back between steps
        runner.step([seq], [[t]])
    assert any(HOLE in table for table in seq.kv.tables)  # a sliding group gave back pages left of its window
    runner.free(seq)
    runner.check_integrity()



def test_stats_name_the_rotation_of_the_pages(capsys):
    """--stats (cli.print_stats) and the cache's statistics say that the pages are rotated."""
    from kvcache.cli import print_stats

    for spec, shown in (("int4,rotate", "int4,rotate"), ("int4", "int4")):
        llm = LLM(kv=spec, prefix=False)  # the bundled model (head size 64: int4's groups of 32)
        llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2))
        stats = llm.kv_stats()
        assert stats is not None and stats.encoding == shown
        print_stats(stats)
        assert f"· {shown} · page" in capsys.readouterr().err
