"""What reads a kernel's float32 scalar parameters, from its PTX (used by tests/triton_sm90.py for the Triton kernels
and by tests/test_kernels_build.py for csrc/*.cu).

The prefill attention statistics form each row's scores s = q.k * scale in more than one kernel, and a row is only
normalised if every kernel rounds s the same way. A plain product can be contracted with the subtraction after it
into one fused multiply-add (Triton's enable_fp_fusion, nvcc's --fmad=true; ptxas contracts a `mul.f32` followed
by a `sub.f32` too): the exact product, not the rounded one. Only `mul.rn.f32` is never contracted, so the check is
that the scale parameter is read by `mul.rn` instructions and nothing else.
"""

from __future__ import annotations

import re

_ENTRY = re.compile(r"^\.(?:visible\s+)?\.?entry\s+(\S+?)\s*\(", re.M)


def entries(ptx: str) -> dict[str, str]:
    """{entry name: its text up to the next entry} of a PTX module."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    return {name: ptx[a:b] for (a, name), (b, _) in zip(starts, starts[1:] + [(len(ptx), "")])}


def f32_param_uses(body: str) -> dict[str, list[str]]:
    """{f32 parameter name: the instructions (whole lines) that read the register it is loaded into} for one entry.
    A register copied with `mov` is followed (ptxas and NVVM sometimes move a parameter before use)."""
    out = {}
    for param in re.findall(r"\.param\s+\.f32\s+(\w+)", body):
        regs = set(re.findall(r"ld\.param\.[bf]32\s+(%\w+),\s*\[" + re.escape(param) + r"\]", body))
        uses: list[str] = []
        seen: set[str] = set()
        while regs - seen:
            reg = (regs - seen).pop()
            seen.add(reg)
            for line in body.splitlines():
                line = re.sub(r"^@!?%\w+\s+", "", line.strip())  # (a guard predicate is not the opcode)
                if not line or line.startswith(("ld.param", "//")):
                    continue
                ops = line.rstrip(";").split(None, 1)
                if len(ops) < 2:
                    continue
                operands = [o.strip() for o in ops[1].split(",")]
                if reg not in operands[1:]:
                    continue
                if ops[0].startswith("mov."):
                    regs.add(operands[0])
                else:
                    uses.append(line)
        out[param] = uses
    return out


def opcodes(lines: list[str]) -> list[str]:
    """The distinct opcodes (`mul.rn.f32`, `fma.rn.f32`, ...) of PTX instruction lines, sorted."""
    return sorted({line.split()[0] for line in lines})
