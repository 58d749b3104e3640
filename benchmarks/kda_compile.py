"""Compile every Triton KDA launch of one chunked forward+backward, one forward on 16-token tiles, one on
pairs of tiles and one decode step for a GPU target on a machine without a GPU, and report each
kernel's registers and stack (spill) bytes.

The device is the scarce resource: this checks that changed kernels compile for the H200 (``sm_90``) and
compares their register pressure before a device run. It records the launches by calling the real launchers
(:func:`~openk3.ops.kda.triton.chunk_function.chunk_kda_triton`,
:func:`~openk3.ops.kda.triton.decode.fused_recurrent_kda_decode`) on CPU tensors with the kernels' launch
replaced by a recorder, then compiles each recorded signature with ``triton.compile`` and reads the
resources from the cubin with the ``cuobjdump`` that ships with triton's NVIDIA backend.

Each launch is compiled with the alignment hints triton's GPU launcher would add (:func:`divisibility`):
without them the compiler vectorises no load and pipelines no loop, and this reported 255 registers for the
64-token state pass with ``o`` where Nsight Compute measured 132 on the H200; with them, triton 3.6 gives
148 (the backward's state passes 128 and 143, no stack). The launches are those a CPU call makes, so a
setting chosen per device (``StateLaunch.few_program_stages``) is compiled as on a GPU with many
programs; ``--geometry chunk_state.few_program_stages=0 --geometry chunk_state.num_stages=2`` compiles the
other. The numbers come from the installed
triton's compiler: use them to check that kernels compile and to compare variants. The device runs triton
3.6; to match it, install that version into a side directory and put it first::

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:src python benchmarks/kda_compile.py

Usage: ``python benchmarks/kda_compile.py [--arch 90] [--geometry KERNEL.FIELD=INT ...]``; ``--geometry``
compiles the launches under another :class:`~openk3.ops.kda.triton.config.LaunchConfig` (a field of one
kernel's launch replaced, ``--geometry chunk_grad_wy.key_block=32``), checked before anything compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

TORCH_TO_TRITON = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
OPTION_KEYWORDS = ("num_warps", "num_stages", "maxnreg")


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments by name and the launch options."""

    fn: object
    args: dict
    options: dict


@contextlib.contextmanager
def recorded_launches():
    """Within the block, ``kernel[grid](...)`` records a :class:`Launch` instead of running; yields the
    list."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def getitem(fn, grid):
        def record(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in OPTION_KEYWORDS if k in kwargs}
            named = dict(zip(fn.arg_names, args)) | kwargs
            launches.append(Launch(fn, named, options))

        return record

    saved = JITFunction.__getitem__
    JITFunction.__getitem__ = getitem
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = saved


def record_kda_launches(launch=None) -> list[Launch]:
    """The launches of a B1 T128 H96 D128 bf16 chunked forward+backward (K3 gate, L2 norm, β as logits with
    ``use_beta_sigmoid_in_kernel``; initial state), of the forward without autograd on 16-token tiles, of the
    same forward on pairs of tiles (``tile_pairs.pair_forward``) and of one decode step on a state pool, in
    order, under the geometry ``launch`` (None: the default)."""
    from openk3.ops.kda.triton.chunk_function import chunk_kda_triton
    from openk3.ops.kda.triton.chunk_index import fixed_length_index
    from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY, DEFAULT_OPTIONS
    from openk3.ops.kda.triton.decode import fused_recurrent_kda_decode
    from openk3.ops.kda.triton.tile_pairs import PAIR, pair_forward

    launch = DEFAULT_GEOMETRY if launch is None else launch
    B, T, H, D = 1, 128, 96, 128
    bf = torch.bfloat16
    q, k, v, g = (torch.randn(B, T, H, D, dtype=bf, requires_grad=True) for _ in range(4))
    beta = torch.randn(B, T, H, dtype=bf, requires_grad=True)  # logits
    A_log = torch.zeros(H, requires_grad=True)
    dt_bias = torch.zeros(H * D, requires_grad=True)
    h0 = torch.zeros(B, H, D, D, requires_grad=True)
    kw = dict(
        scale=D**-0.5, initial_state=h0, output_final_state=True, seq_lens=None, cu_seqlens=None,
        use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True, launch=launch,
    )  # fmt: skip
    with recorded_launches() as launches:
        o, ht = chunk_kda_triton(q, k, v, g, beta, **kw)
        (o.float().sum() + ht.sum()).backward()
        with torch.no_grad():
            chunk_kda_triton(q, k, v, g, beta, **kw)
        with torch.no_grad():  # the forward on pairs of tiles (a GPU call of at most one program per SM)
            flat = (t.detach()[0] for t in (q, k, v, g))
            pair_forward(
                *flat, beta.detach()[0], A_log.detach(), dt_bias.detach(), h0.detach(),
                fixed_length_index(B, T, q.device, PAIR), scale=D**-0.5, lower_bound=-5.0, use_l2norm=True,
                output_final_state=True, beta_sigmoid=True, options=DEFAULT_OPTIONS, launch=launch,
            )  # fmt: skip
        pool = torch.zeros(4, H, D, D)
        fused_recurrent_kda_decode(
            q[:, :1].detach(), k[:, :1].detach(), v[:, :1].detach(), g[:, :1].detach(), beta[:, :1].detach(),
            pool, torch.tensor([2]), A_log=A_log.detach(), dt_bias=dt_bias.detach(), lower_bound=-5.0,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    return launches


def signature(launch: Launch) -> tuple[dict, dict]:
    """``(signature, constexprs)`` for :class:`triton.compiler.ASTSource` from a recorded launch."""
    sig, const = {}, {}
    for i, param in enumerate(launch.fn.params):
        value = launch.args.get(param.name, param.default)
        if param.is_constexpr or value is None:
            sig[param.name] = "constexpr"
            const[(i,)] = value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = "*" + TORCH_TO_TRITON[value.dtype]
        elif isinstance(value, bool):
            sig[param.name] = "i1"
        elif isinstance(value, int):
            sig[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[param.name] = "fp32"
        else:
            raise TypeError(f"{launch.fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return sig, const


def compile_launch(launch: Launch, arch: int):
    """Compile one recorded launch for ``sm_<arch>``; returns triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const = signature(launch)
    source = ASTSource(launch.fn, sig, constexprs=const, attrs=divisibility(launch))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def divisibility(launch: Launch) -> dict:
    """The alignment hints triton's GPU launcher adds to a call: ``tt.divisibility`` 16 for each tensor whose
    data pointer is a multiple of 16 bytes and each int argument that is a multiple of 16. Without them the
    compiler assumes unaligned pointers, vectorises no load and pipelines no loop, so ``num_stages`` changed
    nothing offline and the state passes reported 255 registers where Nsight Compute measured 132."""
    attrs = {}
    for i, param in enumerate(launch.fn.params):
        value = launch.args.get(param.name, param.default)
        if param.is_constexpr or value is None or isinstance(value, bool):
            continue
        if isinstance(value, torch.Tensor):
            aligned = value.data_ptr() % 16 == 0
        else:
            aligned = isinstance(value, int) and value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resources(cubin: bytes) -> dict:
    """``{"REG": n, "STACK": bytes, "SHARED": bytes, ...}`` of a cubin, from
    ``cuobjdump --dump-resource-usage``."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        )
    fields = {}
    for line in out.stdout.splitlines():
        if "REG:" in line:
            for item in line.split():
                key, _, val = item.partition(":")
                if val.isdigit():
                    fields[key] = int(val)
    return fields


def geometry(items: list[str]):
    """The :class:`~openk3.ops.kda.triton.config.LaunchConfig` of ``--geometry KERNEL.FIELD=INT`` items.

    Raises:
        ValueError: not of that form, not an int, an unknown kernel or field, or a geometry the config
            refuses (each names the item)."""
    from kda import swept  # benchmarks/kda.py's sweep builds its configs the same way

    picks: dict[str, dict] = {}
    for item in items:
        target, sep, text = item.partition("=")
        kernel, _, field = target.partition(".")
        if not sep or not kernel or not field:
            raise ValueError(f"{item}: expected KERNEL.FIELD=INT, e.g. chunk_grad_wy.key_block=32")
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{item}: {text!r} is not an int") from None
        picks.setdefault(kernel, {})[field] = value
    return swept(picks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability ×10 (default 90, the H200)")
    parser.add_argument("--geometry", action="append", default=[], metavar="KERNEL.FIELD=INT")
    args = parser.parse_args()
    if not 70 <= args.arch < 1000:
        sys.exit(f"--arch {args.arch}: expected a CUDA compute capability ×10 such as 80, 90 or 100")
    try:  # a bad geometry fails here, not after the table's header
        launch = geometry(args.geometry)
    except ValueError as err:
        sys.exit(f"--geometry: {err}")
    import triton

    print(
        f"triton {triton.__version__}, sm_{args.arch}; "
        "launches of chunk fwd+bwd (B1 T128 H96 D128 bf16), tile fwd, pair fwd, decode"
    )
    print(f"{'kernel':34s} {'warps':>5s} {'regs':>5s} {'stack B':>8s} {'shared B':>9s}")
    for recorded in record_kda_launches(launch):
        compiled = compile_launch(recorded, args.arch)
        res = resources(compiled.asm["cubin"])
        print(
            f"{recorded.fn.__name__:34s} {recorded.options.get('num_warps', 4):5d} {res.get('REG', -1):5d} "
            f"{res.get('STACK', -1):8d} {compiled.metadata.shared:9d}",
            flush=True,
        )


if __name__ == "__main__":
    main()
