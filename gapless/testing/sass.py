"""A compiled Triton kernel's binary, read with the cuobjdump Triton ships: its resources (registers,
spills, shared memory) and its SASS's instruction mix. For the sm_90 compile harness
(`gapless.testing.triton_compile`) and the tests that read what a kernel compiled to; no GPU needed."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Any


def cuobjdump(kernel: Any, flag: str) -> str | None:
    """What Triton's cuobjdump prints of a compiled kernel's binary with `flag`; None if it is missing."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(kernel: Any) -> dict[str, int]:
    """A compiled kernel's registers, spill bytes ("local") and shared memory (static and Triton's dynamic)
    per program, from its binary; empty if cuobjdump is missing."""
    out = cuobjdump(kernel, "--dump-resource-usage")
    if out is None:
        return {}
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", out))
    return {
        "registers": int(fields.get("REG", 0)),
        "spill_bytes": int(fields.get("LOCAL", 0)),
        "shared_bytes": int(fields.get("SHARED", 0)) + int(kernel.metadata.shared),
        "warps": int(kernel.metadata.num_warps),
    }


CONVERSIONS = ("I2F", "I2FP", "F2I", "F2F", "F2FP", "I2I")  # the SASS opcodes that convert a number's type


def instruction_mix(kernel: Any) -> dict[str, Any]:
    """A compiled kernel's SASS, counted: its instructions, its matrix instructions (HMMA: mma.sync; HGMMA,
    QGMMA: Hopper's wgmma, QGMMA on fp8) and each conversion opcode with its count (most run on a
    slower pipe than float math); empty if cuobjdump is missing."""
    sass = cuobjdump(kernel, "-sass")
    if sass is None:
        return {}
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass, flags=re.M)
    return {
        "instructions": len(ops),
        "mma": sorted({op for op in ops if "MMA" in op.split(".")[0]}),
        "conversions": dict(Counter(op for op in ops if op.split(".")[0] in CONVERSIONS)),
    }
