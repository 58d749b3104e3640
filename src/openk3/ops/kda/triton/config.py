"""What a caller of the Triton KDA chooses: the memory/precision trades (:class:`KDAOptions`) and the launch
geometry of every kernel (:class:`LaunchConfig`, frozen defaults; benchmark sweeps pass another one).

Both are frozen dataclasses passed as arguments (``chunk_kda_triton(..., options=, launch=)``); nothing here
is read from or written to a module at run time. Each ``__post_init__`` raises ``ValueError`` naming the field.

Legend: ``K``/``V`` key/value dims, ``BK``/``BV`` key/value blocks (tensor-core operands: powers of two ≥ 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

WARPS = (1, 2, 4, 8, 16)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(obj, **kinds: str) -> None:
    """Raise ``ValueError`` unless each named field of ``obj`` is of its kind: ``warps``, ``stages`` (int ≥ 1),
    ``count`` (int ≥ 0), ``block`` (int power of two ≥ 16) or ``block_or_0`` (that, or 0: chosen per call)."""
    name = type(obj).__name__
    for key, kind in kinds.items():
        x = getattr(obj, key)
        block = _is_int(x) and x >= 16 and not x & (x - 1)
        ok, want = {
            "warps": (_is_int(x) and x in WARPS, f"an int in {WARPS}"),
            "stages": (_is_int(x) and x >= 1, "an int >= 1"),
            "count": (_is_int(x) and x >= 0, "an int >= 0"),
            "block": (block, "an int power of two >= 16 (a tensor-core operand)"),
            "block_or_0": (
                block or (_is_int(x) and x == 0),
                "0 (chosen per call) or an int power of two >= 16",
            ),
        }[kind]
        if not ok:
            raise ValueError(f"{name}.{key} must be {want}; got {x!r}")


@dataclass(frozen=True)
class KDAOptions:
    """The memory/precision trades of the chunked Triton KDA (all off by default).

    ``keep_residuals``: the training forward keeps the delta-rule residuals ``E`` its tile recurrence forms
    (``V`` values per token and head in the input dtype, 256 bytes at V = 128 bf16, on top of the 264 bytes
    the backward always saves), so that the backward rebuilds the chunk-start states from them
    (``S ← Diag(D) S + K̂ᵀ E``, no product through ``S`` on the chain) and its prepare skips ``U``. Faster
    backward for more saved activations per layer; the gradients are not bitwise those without it (the
    backward then reads ``E`` as the tile recurrence rounded it).

    ``fp32_gated_keys``: the tile prepare stores ``Q̃``, ``K̃``, ``K̂`` in fp32 for 16-bit inputs too, so the
    recurrence's products take tf32 operands instead of 16-bit ones. For the delta rule's worst conditioning
    (nearly parallel keys, β ≈ 1, little decay), where the residual ``E = V − K̃S`` cancels and 16-bit gated
    keys carry ``o`` and the final state past 5e-3 of the fp64 reference; twice those three tensors' bytes.
    """

    keep_residuals: bool = False
    fp32_gated_keys: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"KDAOptions.{f.name} must be True or False; got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class KernelLaunch:
    """Warps and software-pipeline stages of one kernel, with its key and value blocks where it has them
    (0 where unused)."""

    num_warps: int
    num_stages: int = 1
    key_block: int = 0
    value_block: int = 0

    def __post_init__(self) -> None:
        _check(self, num_warps="warps", num_stages="stages", key_block="block_or_0", value_block="block_or_0")

    def options(self) -> dict:
        """Triton launch keywords."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class StateLaunch(KernelLaunch):
    """The 64-token state passes (forward-direction and reverse): ``few_program_stages`` replaces
    ``num_stages`` where a pass has at most one program per multiprocessor (0: never), ``min_programs`` the
    fewest programs for which the per-call value block is 64 wide (else 32), ``value_block`` > 0 fixes it."""

    few_program_stages: int = 2
    min_programs: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self, few_program_stages="count", min_programs="count")


@dataclass(frozen=True)
class GradWYLaunch(KernelLaunch):
    """The WY backward's two kernels; the value block is kept below four key blocks (such a pair faulted on
    the H200 and was slower)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self, key_block="block", value_block="block")
        if self.value_block >= 4 * self.key_block:
            raise ValueError(
                f"GradWYLaunch.value_block ({self.value_block}) must be less than 4 x key_block ({self.key_block})"
            )


@dataclass(frozen=True)
class PipelineLaunch:
    """How the backward of one long sequence is cut: ``segments`` pieces on the chunk grid (``< 2``: never)
    once it has at least ``min_tokens`` tokens."""

    segments: int = 4
    min_tokens: int = 16384

    def __post_init__(self) -> None:
        _check(self, segments="count", min_tokens="count")


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's value block: ``small_bv`` below ``large_programs`` (sequence, head) pairs,
    ``large_bv`` from there."""

    small_bv: int = 32
    large_bv: int = 64
    large_programs: int = 1024

    def __post_init__(self) -> None:
        _check(self, small_bv="block", large_bv="block", large_programs="count")


def _default(launch):
    return field(default_factory=lambda: launch)


@dataclass(frozen=True)
class LaunchConfig:
    """Launch geometry of every kernel of the Triton KDA, the defaults chosen on the H200 (docs/LOG.md).
    ``tile_prepare.key_block``: the prepare's key slice; ``tile_recurrence.value_block``: 0 chooses it as the
    state passes do (:func:`~openk3.ops.kda.triton.chunk_state.value_block`); ``chunk_prepare.key_block``:
    the slice of its ``W``/``U``/``Q̃``/``K̂`` pass (also the value slice)."""

    tile_prepare: KernelLaunch = _default(KernelLaunch(num_warps=1, key_block=64))
    tile_recurrence: KernelLaunch = _default(KernelLaunch(num_warps=4, num_stages=3))
    chunk_from_tiles: KernelLaunch = _default(KernelLaunch(num_warps=2, key_block=32))
    chunk_prepare: KernelLaunch = _default(KernelLaunch(num_warps=4, key_block=64))
    chunk_state: StateLaunch = _default(StateLaunch(num_warps=4))
    chunk_grad_wy: GradWYLaunch = _default(
        GradWYLaunch(num_warps=4, num_stages=2, key_block=64, value_block=64)
    )
    chunk_grad_intra: KernelLaunch = _default(KernelLaunch(num_warps=4, key_block=32))
    pipeline: PipelineLaunch = _default(PipelineLaunch())
    decode: DecodeLaunch = _default(DecodeLaunch())

    def __post_init__(self) -> None:
        for f in fields(self):
            want = globals()[f.type]
            if not isinstance(getattr(self, f.name), want):
                raise ValueError(
                    f"LaunchConfig.{f.name} must be a {want.__name__}; got {getattr(self, f.name)!r}"
                )
        for key in ("tile_prepare", "chunk_from_tiles", "chunk_prepare", "chunk_grad_intra"):
            if getattr(self, key).key_block == 0:
                raise ValueError(f"LaunchConfig.{key}.key_block must be a power of two >= 16; got 0")


DEFAULT_OPTIONS = KDAOptions()
"""All trades off (frozen)."""
DEFAULT_GEOMETRY = LaunchConfig()
"""The default launch geometry (frozen)."""
