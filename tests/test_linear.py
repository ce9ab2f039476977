"""fastrag.model.linear.Linear: the oneDNN CPU GEMM equals torch's, and its packed weight follows every change."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from fastrag.model import linear as L
from fastrag.model.linear import Linear, onednn_available, set_cpu_gemm

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN prepacked linear")


def _layer(k, n, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.requires_grad_(False)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (3, 576), (8, 576), (33, 576), (2, 5, 576), (1, 1, 576)])
@pytest.mark.parametrize("n", [960, 49])
def test_onednn_equals_torch_gemm(shape, n, bias):
    lin = _layer(576, n, bias, seed=n + len(shape))
    x = torch.randn(*shape)
    with torch.inference_mode():
        assert lin.uses_onednn(x)
        got = lin(x)
    assert lin._packed is not None  # the oneDNN path ran
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_non_contiguous_input():
    lin = _layer(64, 32, True)
    x = torch.randn(16, 128)[:, ::2]  # stride 2 in the last dimension
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_weight_follows_in_place_edits_new_storage_and_state_dict():
    lin = _layer(64, 48, False)
    x = torch.randn(4, 64)
    with torch.no_grad():
        lin(x)
        first = lin.packed_weight()
        assert lin.packed_weight() is first  # no change: no repack
        lin.weight[:8] = 0  # in place (version counter)
        torch.testing.assert_close(lin(x)[:, :8], torch.zeros(4, 8))
        lin.weight.data = torch.randn(48, 64)  # new storage
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
        sd = {"weight": torch.randn(48, 64)}
        lin.load_state_dict(sd)
        torch.testing.assert_close(lin(x), F.linear(x, sd["weight"]), rtol=1e-5, atol=1e-5)
    assert lin.packed_weight() is not first


@needs_onednn
def test_tied_output_projection_follows_the_embedding():
    emb = torch.nn.Embedding(40, 16)
    head = Linear(16, 40, bias=False)
    head.weight = emb.weight
    x = torch.randn(3, 16)
    with torch.no_grad():
        head(x)
        emb.weight[5] = 0
        out = head(x)
    assert torch.equal(out[:, 5], torch.zeros(3))


def test_autograd_uses_torch_gemm_and_gets_gradients():
    lin = Linear(16, 8, bias=True)
    x = torch.randn(4, 16, requires_grad=True)
    assert not lin.uses_onednn(x)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(x.grad, lin.weight.detach().sum(0).expand(4, 16))


@needs_onednn
def test_set_cpu_gemm_switches_and_frees_the_copy():
    model = torch.nn.Sequential(_layer(32, 24, True), torch.nn.ReLU(), _layer(24, 8, False, seed=1))
    x = torch.randn(5, 32)
    with torch.no_grad():
        fast = model(x)
        assert all(m._packed is not None for m in model if isinstance(m, Linear))
        set_cpu_gemm(model, "torch")
        assert all(m._packed is None and not m.onednn for m in model if isinstance(m, Linear))
        plain = model(x)
        assert all(m._packed is None for m in model if isinstance(m, Linear))
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cpu gemm mode 'mkl'"):
        set_cpu_gemm(model, "mkl")


def test_env_selects_the_gemm(monkeypatch):
    monkeypatch.setenv(L.CPU_GEMM_ENV, "torch")
    assert Linear(4, 4).onednn is False
    monkeypatch.setenv(L.CPU_GEMM_ENV, "blas")
    with pytest.raises(ValueError, match=r"FASTRAG_CPU_GEMM='blas'"):
        Linear(4, 4)


@needs_onednn
def test_copies_drop_the_packed_weight_and_rebuild_it():
    lin = _layer(32, 16, True)
    x = torch.randn(2, 32)
    with torch.no_grad():
        want = lin(x)
        for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert other._packed is None
            torch.testing.assert_close(other(x), want)
            assert other._packed is not None


@needs_onednn
def test_moving_the_layer_drops_the_copy():
    lin = _layer(16, 8, True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        lin(x)
        assert lin._packed is not None
        lin.double()
        assert lin._packed is None and not lin.uses_onednn(x.double())
        torch.testing.assert_close(lin(x.double()), F.linear(x.double(), lin.weight, lin.bias))
        lin.float()
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert lin._packed is not None
