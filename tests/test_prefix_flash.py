"""The shared prefixes of a decode step in one flash-decoding launch (kernels/fused_decode.py prefix_flash_decode,
$FASTRAG_PREFIX_FLASH=1) against fastrag.signals.reference.cascade_decode_ref, and a decode through the engine with
it against one without.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (set before fastrag.kernels is imported);
with one, on the GPU (bf16 too). Outputs and scratch buffers are NaN-poisoned: every float tensor the call
allocates starts as NaN, so a value the kernels do not write shows.
"""

from __future__ import annotations

import random

import pytest
import torch
# (test_fused_decode sets TRITON_INTERPRET=1 without a GPU before fastrag.kernels is imported)
from test_fused_decode import DEV, DTYPES, INTERPRETED, _assert_same_decodes, _unfused_and_fused, fd

from fastrag.model import llama
from fastrag.model.attention import select
from fastrag.signals.reference import cascade_decode_ref

pytestmark = pytest.mark.skipif(DEV == "cpu" and not INTERPRETED,
                                reason="no GPU and fastrag.kernels was imported without TRITON_INTERPRET=1")


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like fill floating tensors with NaN for the test's duration."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def _case(B, H, Hkv, D, lens_pre, dtype, g, none_rows=True):
    """Pools with len(lens_pre) prefixes in consecutive slots (after a gap) and each row's own context in shuffled
    blocks of 4 slots; row_prefix random (-1 too, when none_rows)."""
    bs = 4
    starts, s = [], 8
    for n in lens_pre:
        starts.append(s)
        s += n + 5
    own_lens = torch.randint(1, 14, (B,), generator=g)
    nb = int((own_lens.max() + bs - 1) // bs)
    first_block = (s + bs - 1) // bs
    blocks = torch.randperm(B * nb, generator=g).view(B, nb) + first_block
    n_slots = (first_block + B * nb) * bs
    kp = torch.randn(Hkv, n_slots, D, generator=g).to(dtype)
    vp = torch.randn(Hkv, n_slots, D, generator=g).to(dtype)
    q = (torch.randn(B, H, D, generator=g) * 2).to(dtype)
    lo = -1 if none_rows else 0
    rp = torch.randint(lo, len(lens_pre), (B,), generator=g, dtype=torch.int32)
    return q, kp, vp, starts, rp, blocks, own_lens, bs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,D,lens_pre,rows,splits", [
    (1, 4, 4, 16, [9], None, None),          # one row, one prefix, no GQA
    (5, 6, 2, 24, [13, 40, 7], None, 3),     # GQA (G 3), three prefixes, head dim not a power of two, 3 splits
    (37, 2, 1, 16, [33, 17], 16, 2),         # several row blocks, a prefix longer than a split
    (9, 8, 2, 32, [5, 5, 5, 5], 4, None),    # four prefixes (the most one launch takes)
])
def test_prefix_flash_equals_one_softmax_over_prefix_and_own_keys(poisoned, dtype, B, H, Hkv, D, lens_pre, rows,
                                                                  splits):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, starts, rp, blocks, own_lens, bs = _case(B, H, Hkv, D, lens_pre, dtype, g)
    scale = D ** -0.5
    pre_slots = [list(range(s, s + n)) for s, n in zip(starts, lens_pre)]
    want, want_lse = cascade_decode_ref(q, kp, vp, pre_slots, rp, blocks, own_lens, bs, scale)
    o_own, lse_own = cascade_decode_ref(q, kp, vp, pre_slots, torch.full_like(rp, -1), blocks, own_lens, bs, scale)
    out, lse = fd.prefix_flash_decode(q.to(DEV), kp.to(DEV), vp.to(DEV), starts, lens_pre, rp.to(DEV),
                                      o_own.to(dtype).to(DEV), lse_own.float().to(DEV), scale,
                                      num_splits=splits, rows_per_block=rows, block_n=16)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    msg = lambda m: f"{m} (seed={seed})"  # noqa: E731
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any(), msg("a value the kernels left unwritten")
    torch.testing.assert_close(out.cpu().double(), want, **tol, msg=msg)
    torch.testing.assert_close(lse.cpu().double(), want_lse, **tol, msg=msg)
    none = rp < 0  # rows of no prefix keep their own part exactly
    assert torch.equal(out.cpu()[none], o_own.to(dtype)[none])


def test_bad_arguments_name_the_problem():
    g = torch.Generator().manual_seed(0)
    q, kp, vp, starts, rp, _, _, _ = _case(3, 4, 2, 16, [8, 8], torch.float32, g)
    o, l = torch.zeros(3, 4, 16), torch.zeros(3, 4)
    args = lambda **kw: dict(dict(q=q, k_pool=kp, v_pool=vp, starts=starts, lengths=[8, 8], row_prefix=rp,  # noqa
                                  o_own=o, lse_own=l, scale=0.25), **kw)
    for kw, match in ((dict(lengths=[8]), "starts and lengths: 1 to 4 prefixes"),
                      (dict(starts=[0] * 5, lengths=[1] * 5), "starts and lengths: 1 to 4 prefixes"),
                      (dict(starts=[8, kp.shape[1] - 2]), "does not lie in the pool's"),
                      (dict(lengths=[8, 0]), "does not lie in the pool's"),
                      (dict(row_prefix=rp.float()), "row_prefix: expected int"),
                      (dict(lse_own=l.double()), "lse_own: expected a contiguous float32"),
                      (dict(o_own=o[:2]), "o_own: expected"),
                      (dict(q=q[:, :3]), "does not fit the pool")):
        with pytest.raises(ValueError, match=match):
            fd.prefix_flash_decode(**args(**kw))
    with pytest.raises(ValueError, match="rows_per_block must be a power of two"):
        fd.prefix_flash_decode(**args(), rows_per_block=24)


def test_the_models_limit_is_the_kernels():
    assert llama.FLASH_PREFIXES == fd.MAX_FLASH_PREFIXES


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("FASTRAG_PREFIX_FLASH", raising=False)
    assert select.prefix_flash_mode() is False
    monkeypatch.setenv("FASTRAG_PREFIX_FLASH", "1")
    assert select.prefix_flash_mode() is True
    monkeypatch.setenv("FASTRAG_PREFIX_FLASH", "maybe")
    with pytest.raises(ValueError, match=r"\$FASTRAG_PREFIX_FLASH='maybe'"):
        select.prefix_flash_mode()


@pytest.mark.parametrize("graphs", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "graphs"])
def test_engine_decode_with_the_flash_prefixes_equals_without(graphs, monkeypatch):
    """Two shared prefixes and a prompt with none, DRAGIN's attention tracking on (the last layer's merged LSE):
    the same tokens, log-probabilities, entropies and tracked attention as the unfused decode, and the flash
    kernel took the decode steps (eagerly: each step's rows as index lists; from graphs: member masks)."""
    calls = []
    real = fd.prefix_flash_decode

    def counted(*a, **kw):
        calls.append(len(a[3]))
        return real(*a, **kw)

    monkeypatch.setattr(fd, "prefix_flash_decode", counted)
    want, got = _unfused_and_fused(graphs, prefix_flash=True)
    assert calls and max(calls) == 2, calls  # (steps of both prefixes in one launch a layer; none unfused)
    _assert_same_decodes(got, want)


@pytest.mark.parametrize("flash,other", [("0", "flash"), pytest.param("1", "GEMMs", marks=pytest.mark.slow)])
def test_bench_decode_times_the_other_prefix_path(tmp_path, monkeypatch, flash, other):
    """bench_decode's "other prefix path ms" column: with shared prefixes and the fused kernels in use, the step
    timed with the prefixes the other way than the run's ($FASTRAG_PREFIX_FLASH), named; '-' without prefixes."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("_bench_decode_flash", bench / "bench_decode.py")
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    monkeypatch.setenv("FASTRAG_FUSED_DECODE", "1")
    monkeypatch.setenv("FASTRAG_PREFIX_FLASH", flash)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--cpu-small", "--shape", "tiny", "--batches", "3",
                                      "--ctx", "20", "--reps", "1", "--span", "4", "--prefixes", "0", "2",
                                      "--prefix-len", "32", "--results", str(tmp_path)])
    bd.main()
    md = (tmp_path / "decode_cpu_tiny.md").read_text()
    rows = [line.strip("| ").split(" | ") for line in md.splitlines() if line.startswith("| 20 |")]
    assert [r[-1] for r in rows] == ["0", "2 x 32"], md
    assert rows[0][-2] == "-", md
    ms, name = rows[1][-2].split()
    assert float(ms) > 0 and name == f"({other})", md
