"""Multi-teacher on-policy distillation (MOPD): a dense per-token reward from the teacher of the rollout's
(domain, effort).

The student samples; the teacher scores the *realised* tokens in one prefill over prompt + response
(:func:`openk3.rl.logprobs.response_logprobs`), and every token gets

    r_t = clip(sg(log π_T(y_t | x, y_<t) − log π_S(y_t | x, y_<t)), −R_max, R_max)

(the negative reverse-KL sample of Thinking Machines' "On-Policy Distillation", K. Lu 2025, and Tinker's
``incorporate_kl_penalty``; one teacher per domain as in MiMo-V2-Flash arXiv 2601.02780; the clip bounds the
unbounded log-ratio whose variance PowerOPD arXiv 2606.17199 and Fu et al. arXiv 2603.25562 describe). The
reward enters the advantage with discount 0 (token ``t`` only), added to the outcome advantage.

A teacher must share the student's tokenizer: a different one scores other strings, so
:meth:`TeacherRegistry.register` refuses it (Fu et al. list tokenizer mismatch as a failure mode).

Legend: ``B`` rollouts, ``T`` response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from openk3.rl.logprobs import response_logprobs


@dataclass(frozen=True)
class Teacher:
    model: nn.Module
    tokenizer_id: str
    """Identity of the tokenizer (e.g. a hash of its vocabulary): equal ids ⇔ equal token strings."""
    name: str = ""


@dataclass
class TeacherRegistry:
    """Teachers keyed by ``(domain, effort)``; every teacher shares ``tokenizer_id`` with the student."""

    tokenizer_id: str
    teachers: dict[tuple[str, str], Teacher] = field(default_factory=dict)

    def register(self, domain: str, effort: str, teacher: Teacher) -> None:
        """Add the teacher of ``(domain, effort)``. Raises ``ValueError`` for another tokenizer or a key
        already taken."""
        if teacher.tokenizer_id != self.tokenizer_id:
            raise ValueError(
                f"teacher {teacher.name or (domain, effort)!r} uses tokenizer {teacher.tokenizer_id!r} but the "
                f"student uses {self.tokenizer_id!r}; MOPD scores the student's tokens and needs the same tokenizer"
            )
        if (domain, effort) in self.teachers:
            raise ValueError(f"a teacher for (domain={domain!r}, effort={effort!r}) is already registered")
        self.teachers[(domain, effort)] = teacher

    def get(self, domain: str, effort: str) -> Teacher:
        try:
            return self.teachers[(domain, effort)]
        except KeyError:
            raise KeyError(
                f"no teacher for (domain={domain!r}, effort={effort!r}); registered: {sorted(self.teachers)}"
            ) from None


@torch.no_grad()
def teacher_logprobs(teacher: Teacher, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
    """``log π_T`` of the realised response tokens ``[B, T]`` (0 at padding), one prefill per rollout."""
    was_training = teacher.model.training
    teacher.model.eval()
    try:
        logp_BT, _ = response_logprobs(teacher.model, prompts, responses)
    finally:
        teacher.model.train(was_training)
    return logp_BT


def mopd_reward(
    teacher_logp_BT: torch.Tensor,
    student_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    r_max: float,
    special_mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """``clip(sg(log π_T − log π_S), −r_max, r_max)`` per token, 0 at padding and at special tokens.

    Raises ``ValueError`` for ``r_max`` ≤ 0 or shapes that differ."""
    if not r_max > 0:
        raise ValueError(f"r_max must be > 0, got {r_max}")
    if teacher_logp_BT.shape != student_logp_BT.shape or mask_BT.shape != student_logp_BT.shape:
        raise ValueError(
            f"shapes differ: teacher {tuple(teacher_logp_BT.shape)}, student {tuple(student_logp_BT.shape)}, "
            f"mask {tuple(mask_BT.shape)}"
        )
    r_BT = (teacher_logp_BT - student_logp_BT).detach().clamp(-r_max, r_max) * mask_BT
    if special_mask_BT is not None:
        r_BT = r_BT * (1 - special_mask_BT.to(r_BT.dtype))
    return r_BT
