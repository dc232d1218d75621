"""The project's ops as direct C calls from a compiled package (``c_shim.h``).

Left to itself, an AOTInductor package calls an op it does not know through its proxy executor:
each call packs its arguments into a boxed stack, reads them back against the op's schema and goes
through the dispatcher, about a microsecond per call, and a decode step of the default model makes
some 250 of them. Inductor instead calls an op named in ``aot_inductor.custom_ops_to_c_shims``
straight through a C function, ``aoti_torch_cpu_<op>``, that the op's library defines: each kernel
source ends with its ops' functions (``c_shim.h``), and ``declarations()`` writes their signatures
from the ops' schemas, in the C types the package's generated code passes.

The package's library leaves these symbols to the dynamic linker, so the kernels' library is
loaded into the global namespace (``kernels.available``) before any package.
"""

from __future__ import annotations

import torch

OPS = ("dot8_linear", "dot8_lora", "attend_rows", "rms_norm", "silu_mul", "rotary")


def _c_type(arg: torch.Argument) -> str:
    t = arg.type
    if isinstance(t, torch.OptionalType) and isinstance(t.getElementType(), torch.TensorType):
        return "AtenTensorHandle*"
    if isinstance(t, torch.TensorType):
        return "AtenTensorHandle"
    if isinstance(t, torch.IntType):
        return "int64_t"
    if isinstance(t, torch.FloatType):
        return "double"
    if isinstance(t, torch.BoolType):
        return "int32_t"
    raise TypeError(f"no C shim type for argument {arg.name}: {t}")


def declaration(op: torch._ops.OpOverload) -> str:
    """The C signature inductor calls for ``op``: its arguments, then a handle pointer per output."""
    schema = op._schema
    args = [f"{_c_type(a)} {a.name}" for a in schema.arguments]
    args += [f"AtenTensorHandle* ret{i}" for i in range(len(schema.returns))]
    return f"AOTITorchError aoti_torch_cpu_{schema.name.split('::')[-1]}({', '.join(args)})"


def declarations() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's ``aot_inductor.custom_ops_to_c_shims``: every op of the project's kernels (loaded)."""
    ops = [getattr(torch.ops.dualserve, name).default for name in OPS]
    return {op: [declaration(op)] for op in ops}
