"""Compile every Triton kernel of fastrag.kernels for Hopper (sm_90) on a machine without a GPU.

The Triton interpreter, which runs the kernels on CI's CPUs, accepts programs the GPU compiler rejects (in 2026-11 a
`tl.constexpr` reassigned inside `tl.static_range` passed every interpreted test and failed to compile on the H100).
This script calls each kernel's launcher on small CPU tensors with `JITFunction.run` replaced: a launch is not run
but compiled, ahead of time, through Triton's whole pipeline down to a cubin (`triton.compile` with
`GPUTarget("cuda", 90, 32)`, ptxas from the Triton wheel), with the argument types and constants that launch had.
The outputs stay unwritten: nothing reads them here.

    python tests/triton_sm90.py            # prints one JSON object: {"compiled", "failed", "usage", "scalars"}
    python tests/triton_sm90.py --markdown benchmarks/results/triton_sm90_resources.md   # also the usage table
    python tests/triton_sm90.py --keys     # the launches' specialisations at varying sizes, nothing compiled

Run with TRITON_INTERPRET unset (tests/test_triton_sm90.py runs it in a subprocess), so that `triton.jit` gives
compilable functions and the launchers pick their GPU settings.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import ptx_scan  # noqa: E402  (tests/, this script's folder)

TARGET = GPUTarget("cuda", 90, 32)
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
        torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
        torch.bool: "*i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")

compiled: list[str] = []
failed: dict[str, str] = {}
usage: dict[str, dict] = {}  # label -> {"registers": n, "stack": bytes} (cuobjdump -res-usage of the cubin)
scalars: dict[str, dict] = {}  # label -> {f32 parameter: the PTX opcodes that read it} (tests/ptx_scan.py)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_seen: set[str] = set()


def _bind(self: JITFunction, args, kwargs) -> tuple[dict, dict, str]:
    """A launch's (launch options, every argument by name, "module.kernel")."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    name = f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"
    return options, dict(zip(self.arg_names, args)) | kwargs, name


def _compile_instead(self: JITFunction, *args, grid, warmup, **kwargs):
    """JITFunction.run replaced: the launch's signature compiled for sm_90, nothing launched."""
    options, bound, name = _bind(self, args, kwargs)
    signature, constexprs = {}, {}
    for p in self.params:
        v = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = _PTR[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        elif v is None:
            signature[p.name], constexprs[p.name] = "constexpr", None
        else:
            raise TypeError(f"{self.fn.__name__}: argument {p.name} of type {type(v).__name__}")
    key = name + json.dumps({k: str(v) for k, v in sorted(signature.items())}) + str(sorted(constexprs.items())) \
        + str(sorted(options.items()))
    if key in _seen:
        return None
    _seen.add(key)
    floats = [t[1:] for t in signature.values() if t in ("*bf16", "*fp16", "*fp32", "*fp64")]
    label = f"{name}({', '.join(f'{k}={v}' for k, v in constexprs.items())})" + (f" [{floats[0]}]" if floats else "")
    try:
        kernel = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs), target=TARGET,
                                options=options)
        if not kernel.asm.get("cubin"):
            raise RuntimeError("no cubin came out")
        compiled.append(label)
        usage[label] = _resources(kernel.asm["cubin"])
        scalars[label] = {param: ptx_scan.opcodes(lines) for body in ptx_scan.entries(kernel.asm["ptx"]).values()
                          for param, lines in ptx_scan.f32_param_uses(body).items()}
    except Exception as e:  # noqa: BLE001  (reported, the other kernels go on)
        failed[label] = f"{type(e).__name__}: {str(e)[:2000]}\n{traceback.format_exc(limit=3)}"
    return None


def _resources(cubin: bytes) -> dict:
    """Registers and stack (spill) bytes a thread of the compiled kernel uses, or {} without cuobjdump."""
    import re
    import subprocess
    import tempfile

    if not os.path.exists(CUOBJDUMP):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(m.group(1)), "stack": int(m.group(2))} if m else {}


def _launches() -> None:
    """Each launcher of fastrag.kernels once per code path it can take (dtypes, sampling modes, optional outputs)."""
    from fastrag.kernels import attn_stats, fused_decode, paged_attention, paged_prefill, token_signals

    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        # the model's attention: paged decode (own context), paged prefill
        H, Hkv, D, bs, B = 32, 8, 128, 16, 3
        kp = torch.randn(Hkv, 64 * bs, D, generator=g).to(dt)
        vp = torch.randn_like(kp)
        tab = torch.arange(B * 4).view(B, 4)
        paged_attention.paged_decode_attention_lse(torch.randn(B, H, D, generator=g).to(dt), kp, vp,
                                                   torch.empty(0, dtype=torch.long), tab, torch.tensor([5, 17, 40]),
                                                   bs, D ** -0.5)
        lay = paged_prefill.prefill_layout([5, 9, 2], [5, 20, 40], [(0, 16), (0, 16), (0, 0)],
                                           torch.arange(16) + 60 * bs, tab, bs, block_m=64)
        paged_prefill.paged_prefill_attention(torch.randn(16, H, D, generator=g).to(dt), kp, vp, lay, D ** -0.5)
        # the fused small operations of decode and prefill
        x = torch.randn(4, 256, generator=g).to(dt)
        fused_decode.add_rms_norm(x, None, torch.ones(256, dtype=dt), 1e-5)
        fused_decode.add_rms_norm(x, torch.randn_like(x), torch.ones(256, dtype=dt), 1e-5)
        qkv = torch.randn(4, (H + 2 * Hkv) * D, generator=g).to(dt)
        fused_decode.rope_write_kv(qkv, torch.randn(4, D).to(dt), torch.randn(4, D).to(dt), torch.arange(4), kp, vp,
                                   H, Hkv)
        fused_decode.silu_mul(torch.randn(4, 512, generator=g).to(dt))
        e, stat = fused_decode.prefix_softmax(torch.randn(Hkv, 4 * (H // Hkv), 40, generator=g).to(dt), 0.1, dt)
        num = torch.randn(Hkv, 4 * (H // Hkv), D, generator=g).to(dt)
        o_own, lse_own = torch.randn(4, H, D).to(dt), torch.randn(4, H)
        fused_decode.prefix_merge(num, stat, o_own, lse_own)
        fused_decode.prefix_merge(num, stat, o_own, lse_own, torch.tensor([True, False, True, True]))
        # every shared prefix in one flash launch: GQA (G 4) and no GQA
        for Hq in (H, Hkv):
            fused_decode.prefix_flash_decode(torch.randn(4, Hq, D, generator=g).to(dt), kp, vp, [0, 160], [48, 100],
                                             torch.tensor([0, 1, -1, 1], dtype=torch.int32),
                                             torch.randn(4, Hq, D).to(dt), torch.randn(4, Hq), D ** -0.5)
        # the retrieval signals: decode step (greedy, sampled, nucleus, with and without chosen / nonstop)
        Bs, V = 3, 1000
        logits = torch.randn(Bs, V, generator=g).to(dt)

        def outs(flag: bool):
            return (torch.empty(Bs, dtype=torch.long), torch.empty(Bs), torch.empty(Bs), torch.empty(Bs),
                    torch.empty(Bs, dtype=torch.bool) if flag else None)

        keys = torch.arange(Bs, dtype=torch.long)
        nonstop = torch.ones(V, dtype=torch.bool)
        token_signals.token_signals(logits, 0.0, None, None, None, outs(False))
        token_signals.token_signals(logits, 0.7, None, torch.zeros(Bs, dtype=torch.long), nonstop, outs(True),
                                    greedy=True)
        token_signals.token_signals(logits, 0.8, keys, None, None, outs(False))
        token_signals.token_signals(logits, 0.8, keys, None, nonstop, outs(True), top_p=0.9)
        # the attention statistics: causal passes (column max, rows) and the decode-step update
        T = 40
        q4, k4 = torch.randn(2, H, T, D, generator=g).to(dt), torch.randn(2, Hkv, T, D, generator=g).to(dt)
        lens = torch.tensor([T, 17])
        attn_stats.causal_attn_stats(q4, k4, lens, D ** -0.5, colmax_out=torch.empty(2, T))
        attn_stats.causal_attn_stats(q4, k4, lens, D ** -0.5, rows=torch.tensor([[3, 16], [0, 39]]),
                                     rows_out=torch.empty(2, 2, T))
        span = torch.tensor([0, 2, 10])
        attn_stats.attn_decode_update(torch.randn(B, H, D, generator=g).to(dt), kp, tab, torch.tensor([5, 17, 40]),
                                      span, torch.randn(B, H), bs, D ** -0.5, torch.zeros(B, H, 64),
                                      torch.empty(B, 4 * bs))
        attn_stats.attn_decode_update(torch.randn(B, H, D, generator=g).to(dt), kp, tab, torch.tensor([5, 17, 40]),
                                      span, torch.randn(B, H), bs, D ** -0.5, torch.zeros(B, H, 64), None)


keys: dict[str, set[str]] = {}  # --keys: kernel and its compile constants -> the specialisations its launches got


def _record_key(self: JITFunction, *args, grid, warmup, **kwargs):
    """JITFunction.run replaced (--keys): the specialisation a GPU launch would get, recorded, nothing launched.

    Triton compiles a kernel once per specialisation: an integer argument is specialised on being 1 and on being
    divisible by 16, a pointer on 16-byte alignment, unless the kernel lists it in `do_not_specialize`. A size that
    varies from call to call (a block table's width, a count of rows) therefore compiles new variants inside a timed
    run (on the H200, 2026-11-26d: a 3,719-token prefill step took 838 ms against about 100 ms for its neighbours).
    The key here is Triton's own per-argument specialisation (native_specialize_impl, as its launcher computes it),
    grouped by the launch's constants and argument types, which may legitimately differ between launches."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    options, bound, name = _bind(self, args, kwargs)
    fixed, spec = [], []
    for p in self.params:
        v = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr or v is None:
            fixed.append(f"{p.name}={v}")
            continue
        ty, attr = native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if isinstance(v, int) and not isinstance(v, bool):  # (equal to 1: a compile constant, ty "constexpr")
            spec.append(f"{p.name}:{ty}:{attr}")
        else:
            fixed.append(f"{p.name}:{ty}")
            spec.append(f"{p.name}:{attr}")
    keys.setdefault(f"{name}({', '.join(fixed)}; {sorted(options.items())})", set()).add(", ".join(spec))
    return None


def _launches_varying() -> None:
    """The launchers whose sizes change from call to call in an engine run outside CUDA graphs (prefill, eager
    decode, DRAGIN's attention passes), each at sizes that take every integer specialisation: 1, a multiple of 16,
    neither."""
    from fastrag.kernels import attn_stats, fused_decode, paged_attention, paged_prefill

    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    H, Hkv, D, bs = 32, 8, 128, 16
    kp = torch.randn(Hkv, 512 * bs, D, generator=g).to(dt)
    vp = torch.randn_like(kp)
    for width in (1, 16, 17, 33):  # blocks in the call's table
        for B in (1, 3, 16):
            tab = torch.arange(B * width).view(B, width) % 512
            lens = torch.randint(1, width * bs + 1, (B,), generator=g)
            lens[0] = width * bs
            paged_attention.paged_decode_attention_lse(torch.randn(B, H, D, generator=g).to(dt), kp, vp,
                                                       torch.empty(0, dtype=torch.long), tab, lens, bs, D ** -0.5)
            q_lens = [min(int(n), 1 + i) for i, n in enumerate(lens.tolist())]
            lay = paged_prefill.prefill_layout(q_lens, lens.tolist(), [(0, 16)] * B, torch.arange(16) + 500 * bs,
                                               tab, bs, block_m=64)
            paged_prefill.paged_prefill_attention(torch.randn(sum(q_lens), H, D, generator=g).to(dt), kp, vp, lay,
                                                  D ** -0.5)
            span = torch.zeros(B, dtype=torch.long)
            S = int(lens.max())
            attn_stats.attn_decode_update(torch.randn(B, H, D, generator=g).to(dt), kp, tab, lens, span,
                                          torch.randn(B, H), bs, D ** -0.5, torch.zeros(B, H, S),
                                          torch.empty(B, width * bs))
    for M in (1, 3, 16, 17):  # rows of a prefill or an eager decode step
        x = torch.randn(M, 256, generator=g).to(dt)
        fused_decode.add_rms_norm(x, torch.randn_like(x), torch.ones(256, dtype=dt), 1e-5)
        fused_decode.rope_write_kv(torch.randn(M, (H + 2 * Hkv) * D, generator=g).to(dt), torch.randn(M, D).to(dt),
                                   torch.randn(M, D).to(dt), torch.arange(M), kp, vp, H, Hkv)
        fused_decode.silu_mul(torch.randn(M, 512, generator=g).to(dt))
    for n in (1, 3, 16, 17):  # sequences sharing one prefix
        e, stat = fused_decode.prefix_softmax(torch.randn(Hkv, n * (H // Hkv), 40, generator=g).to(dt), 0.1, dt)
        num = torch.randn(Hkv, n * (H // Hkv), D, generator=g).to(dt)
        fused_decode.prefix_merge(num, stat, torch.randn(n, H, D).to(dt), torch.randn(n, H))
        for starts, lens in (([0], [40]), ([16, 100, 300], [1, 33, 160])):  # the flash launch of 1 or 3 prefixes
            fused_decode.prefix_flash_decode(torch.randn(n, H, D, generator=g).to(dt), kp, vp, starts, lens,
                                             torch.randint(-1, len(starts), (n,), generator=g, dtype=torch.int32),
                                             torch.randn(n, H, D).to(dt), torch.randn(n, H), D ** -0.5)
    for T in (1, 16, 17, 40):  # tokens of an attention pass
        for R in (1, 2, 16):
            q4, k4 = torch.randn(2, H, T, D, generator=g).to(dt), torch.randn(2, Hkv, T, D, generator=g).to(dt)
            lens = torch.tensor([T, max(1, T // 2)])
            attn_stats.causal_attn_stats(q4, k4, lens, D ** -0.5, colmax_out=torch.empty(2, T),
                                         rows=torch.randint(0, T, (2, R), generator=g), rows_out=torch.empty(2, R, T))


def _markdown(path: str) -> None:
    import datetime as dt
    import shlex

    from fastrag.provenance import versions

    lines = ["# Triton kernels compiled for sm_90 without a GPU: registers and spills", "",
             f"- date: {dt.date.today()}; {versions('torch', 'triton')}; target: cuda sm_90, 32-thread warps",
             f"- command: `python tests/triton_sm90.py {shlex.join(sys.argv[1:])}`",
             "- each launcher of fastrag.kernels called on small CPU tensors (32 query heads, 8 kv heads, head dim "
             "128; bf16 and fp32 inputs, the first floating argument's type in brackets), its launch compiled to a cubin instead of run; registers and stack (bytes a thread "
             "spilled to local memory) from `cuobjdump -res-usage`. A compile-time figure, not a timing: what a "
             "spill costs shows only on a GPU.", "",
             "| kernel (constants) | registers | stack bytes |", "|---|---|---|"]
    for label in compiled:
        r = usage.get(label, {})
        lines.append(f"| `{label}` | {r.get('registers', '-')} | {r.get('stack', '-')} |")
    if failed:
        lines += ["", "## Failed", ""] + [f"- `{k}`: {v.splitlines()[0]}" for k, v in failed.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    if "--keys" in sys.argv:  # one JSON object: {kernel and constants: [its specialisations]}
        JITFunction.run = _record_key
        _launches_varying()
        print(json.dumps({k: sorted(v) for k, v in keys.items()}))
        return 0
    JITFunction.run = _compile_instead
    try:
        _launches()
    except Exception:  # noqa: BLE001  (a launcher that refused its inputs: the harness's fault, reported)
        failed["<launchers>"] = traceback.format_exc()
    if "--markdown" in sys.argv:
        _markdown(sys.argv[sys.argv.index("--markdown") + 1])
    print(json.dumps({"compiled": compiled, "failed": failed, "usage": usage, "scalars": scalars}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
