"""The CPU target: TVM's llvm backend with a CPU model chosen from the host's features at run time.

`mcpu=native` silently falls back to SSE2 on some hosts (DESIGN.md §3), so we name a level explicitly, from
the kernel instruction set the host's flags allow (ISAS): x86-64-v4 with VNNI and VBMI, x86-64-v3
where AVX2/FMA/F16C exist, plain x86-64 otherwise; on aarch64 NEON with the dot-product instructions where
/proc/cpuinfo says `asimddp`, generic aarch64 otherwise; a generic target on other machines.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from typing import NamedTuple

import tvm

from jitllm.core.errors import JitllmError
from jitllm.lowering.target import SHARED_LIBRARY, KernelSet, TargetCaps

KERNELS = ("exact", "fast")
"""CPU kernel families (kernels/cpu/linear.py): f32 activations, or int8 activations where the ISA allows."""


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The first CPU's feature flags in /proc/cpuinfo's text: x86's `flags`, aarch64's `Features` line."""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return cpuinfo_flags(f.read())
    except OSError:
        return frozenset()


class Isa(NamedTuple):
    """A kernel instruction set: the host flags it needs (/proc/cpuinfo) and its llvm CPU model."""

    flags: frozenset[str]
    llvm: dict


ISAS = {
    "x86_64": {
        "generic": Isa(frozenset(), {"mcpu": "x86-64"}),
        "avx2": Isa(frozenset({"avx2", "fma", "f16c"}), {"mcpu": "x86-64-v3"}),
        "avx512vnni": Isa(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                                     "avx512vbmi"}), {"mcpu": "x86-64-v4", "mattr": ["+avx512vnni", "+avx512vbmi"]}),
    },
    "aarch64": {
        "generic": Isa(frozenset(), {"mcpu": "generic"}),
        "neon-dotprod": Isa(frozenset({"asimd", "asimddp"}), {"mattr": ["+neon", "+dotprod"]}),
    },
}
"""The kernel instruction sets of each architecture (its llvm triple's first part), each a superset of the
one before: avx512vnni's q4 dot products are vpdpbusd over a vpermb-permuted chunk (kernels/cpu/avx2.py),
neon-dotprod's (Armv8.2-A dot product, `asimddp` in the host's Features) sdot (kernels/cpu/neon.py)."""


def host_arch() -> str | None:
    """The host's architecture as ISAS names it (None: one without kernel ISAs here)."""
    machine = platform.machine().lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(machine)


def host_isas() -> tuple[str, ...]:
    """The instruction sets this host runs, lowest first."""
    arch = host_arch()
    if arch is None:
        return ("generic",)
    return tuple(isa for isa, spec in ISAS[arch].items() if spec.flags <= host_cpu_flags())


def host_isa() -> str:
    """The kernel instruction set used here: the host's highest, or JITLLM_CPU_ISA where set (to compile
    for, or compare with, a lower one: e.g. avx2 for a machine whose CPU is not known here)."""
    chosen = os.environ.get("JITLLM_CPU_ISA")
    if not chosen:
        return host_isas()[-1]
    if chosen not in host_isas():
        raise JitllmError(f"JITLLM_CPU_ISA={chosen}: this host runs {', '.join(host_isas())}")
    return chosen


def isa_arch(isa: str) -> str | None:
    """The architecture whose kernels `isa` names: generic is the host's own."""
    if isa == "generic":
        return host_arch()
    for arch, isas in ISAS.items():
        if isa in isas:
            return arch
    raise JitllmError(f"unknown CPU kernel ISA {isa!r} (known: {', '.join(sorted({i for a in ISAS.values() for i in a}))})")


def isa_target_dict(isa: str) -> dict:
    """TVM's llvm target for kernels of `isa`: the host's architecture for generic, else the ISA's own (so
    the neon-dotprod kernels compile on an x86 host too: tests/lowering/test_cpu_kernels.py)."""
    arch = isa_arch(isa)
    if arch is None:
        return {"kind": "llvm"}
    return {"kind": "llvm", "mtriple": f"{arch}-linux-gnu", **ISAS[arch][isa].llvm}


def host_target_dict() -> dict:
    return isa_target_dict(host_isa())


def relax_pipeline() -> tvm.transform.Pass:
    """tvm.compile's default CPU pipeline plus operator fusion (FuseOps/FuseTIR), which it leaves out for
    CPU targets: RMS norm, RoPE and the SiLU gate become one kernel each instead of 5-8."""
    from tvm import relax
    from tvm.relax import backend, transform

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return tvm.transform.Sequential([
            backend.DispatchSampling(),
            backend.DispatchSortScan(),
            transform.LegalizeOps({"relax.sigmoid": _legalize_sigmoid}),
            transform.AnnotateTIROpPattern(),
            transform.FoldConstant(),
            transform.FuseOps(),
            transform.FuseTIR(),
            transform.RewriteDataflowReshape(),
            transform.ToNonDataflow(),
            transform.RemovePurityChecking(),
            transform.CallTIRRewrite(),
            transform.StaticPlanBlockMemory(),
            transform.LowerAllocTensor(),
            transform.KillAfterLastUse(),
            transform.LowerRuntimeBuiltin(),
            transform.ComputePrimValue(),
            transform.VMShapeLower(),
            _drop_static_param_checks(),
            transform.AttachGlobalSymbol(),
        ])(mod)

    del relax
    return _pipeline


def _drop_static_param_checks() -> tvm.transform.Pass:
    """Remove the VM's per-call checks of parameters whose shape is fully static (the weights).

    VMShapeLower checks every parameter's dtype/ndim and shape on every call (2 VM instructions per
    parameter: 58 of ~150 in a decode step's block). Every TIR kernel checks its own arguments again on
    entry, so for static-shaped parameters the VM-level checks add nothing; symbolic shapes (batch, seq,
    pages) are still matched, since they fill the shape heap."""
    from tvm import relax

    def static_checks(func) -> set:
        drop, tensors = set(), set()
        for block in func.body.blocks:
            for binding in block.bindings:
                call = binding.value
                if not (isinstance(call, relax.Call) and isinstance(call.op, relax.ExternFunc)):
                    continue
                if call.op.global_symbol == "vm.builtin.match_shape":
                    ndim = int(call.args[2].value)
                    codes = [int(a.value) for a in call.args[3:3 + 2 * ndim:2] if hasattr(a, "value")]
                    if len(codes) == ndim and all(c == 0 for c in codes):  # all kAssertEqualToImm
                        drop.add(binding.var)
                        tensors.add(call.args[0])
        for block in func.body.blocks:
            for binding in block.bindings:
                call = binding.value
                if (isinstance(call, relax.Call) and isinstance(call.op, relax.ExternFunc)
                        and call.op.global_symbol == "vm.builtin.check_tensor_info" and call.args[0] in tensors):
                    drop.add(binding.var)
        return drop

    @tvm.transform.module_pass(opt_level=0)
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            drop = static_checks(func)
            if not drop:
                continue
            blocks = [relax.BindingBlock([b for b in block.bindings if b.var not in drop]) for block in func.body.blocks]
            mod[gv] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                                     func.attrs)
        return mod

    return _pass


def _legalize_sigmoid(bb, call):
    """sigmoid with the polynomial exp of kernels_attention.vexp (LLVM turns a libm expf per element
    into a call it cannot vectorise: 10 us per 1536 elements)."""
    from tvm import te

    from jitllm.lowering.kernels.cpu.attention import vexp

    def compute(x):
        return te.compute(x.shape, lambda *i: tvm.tirx.const(1.0, "float32")
                          / (tvm.tirx.const(1.0, "float32") + vexp(-x(*i))), name="sigmoid")

    return bb.call_te(compute, call.args[0], primfunc_name_hint="fast_sigmoid")


class LlvmTarget(KernelSet):
    """Host CPU kernels: kernels/cpu (imported only to compile, since a runtime-only TVM has no TVMScript).

    `kernels`: "exact" (f32 activations; the default, and what the transformers comparisons use) or
    "fast" (int8-quantized activations with integer dot products for the GGML formats: AVX2, AVX-512 VNNI
    or NEON sdot, kernels/cpu/linear.py's INT8_DOTS; with the generic ISA the quantized formats fall back
    to the exact kernels). `isa` defaults to the host's (host_isa).
    The worker count is no part of an artifact: the kernels read the pool's size when they run
    (kernels/cpu/avx2.py), and the runtime sizes the pool (runtime/workers.py).

    Capabilities: decode steps run a batch-1, seq-1 variant of each kind (static shapes cut the Relax
    VM's work per block from ~235 to ~150 instructions, ~18 us of ~100 us on the 2-vCPU VM); Q/K/V and
    gate/up are one matvec each (3 fewer parallel kernel launches per block; on SmolLM2 with 2 threads,
    medians of 5 alternating runs: tg128 197.8 -> 208.8 t/s, pp128 639.6 -> 664.5 t/s), so a block keeps
    one layout on the host and on CUDA.
    """

    name = "llvm"
    caps = TargetCaps(SHARED_LIBRARY, fuse_linears=True, decode_variants=True, ragged_batches=True,
                      kernels_flag="cpu-kernels")
    sources = ("targets/llvm.py", "kernels/cpu", "kernels/formats.py", "kernels/kv_store.py")

    def __init__(self, kernels: str = "exact", isa: str | None = None):
        if kernels not in KERNELS:
            raise JitllmError(f"unknown CPU kernels {kernels!r} (known: {', '.join(KERNELS)})")
        if isa not in (None, *host_isas()):
            raise JitllmError(f"CPU kernels for {isa!r} cannot run on this host ({', '.join(host_isas())})")
        self.kernels = kernels
        self.isa = isa or host_isa()

    @classmethod
    def from_options(cls, arch: str | None, kernels: str) -> "LlvmTarget":
        """The registry's constructor (`arch` is a GPU notion)."""
        return cls(kernels)

    def linear_kernel(self, wtype: str, n: int, k: int, rows: int | None = None):
        """`rows`: static token count of decode variants; the CPU kernels take any M, so it is unused."""
        from jitllm.lowering.kernels.cpu.linear import linear_kernel

        return linear_kernel(wtype, n, k, self.kernels, self.isa)

    def attention_kernel(self, kind):
        from jitllm.lowering.kernels.cpu.attention import attention_kernel

        return attention_kernel(kind)

    def append_kernel(self, kind):
        from jitllm.lowering.kernels.cpu.attention import append_kernel

        return append_kernel(kind)

    def ragged_attention_kernel(self, kind):
        from jitllm.lowering.kernels.cpu.attention import ragged_attention_kernel

        return ragged_attention_kernel(kind)

    def ragged_append_kernel(self, kind):
        from jitllm.lowering.kernels.cpu.attention import ragged_append_kernel

        return ragged_append_kernel(kind)

    def page_kernels(self, kind) -> dict:
        from jitllm.lowering.kernels.cpu.pages import page_kernels

        return page_kernels(kind)

    def moe_kernel(self, wtypes, experts, ffn, hidden, top_k, slots=0):
        from jitllm.lowering.kernels.cpu.moe import moe_kernel

        return moe_kernel(wtypes, experts, ffn, hidden, top_k, slots)

    def recurrence_kernel(self, kind):
        from jitllm.lowering.kernels.cpu.recurrent import recurrence_kernel

        return recurrence_kernel(kind)

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target(isa_target_dict(self.isa))

    def build(self, mod: tvm.IRModule):
        with tvm.transform.PassContext(opt_level=3):
            return tvm.compile(mod, target=self.tvm_target(), relax_pipeline=relax_pipeline())

    def cache_key(self) -> dict:
        return {"target": isa_target_dict(self.isa), "arch": platform.machine(), "kernels": self.kernels,
                "isa": self.isa}
