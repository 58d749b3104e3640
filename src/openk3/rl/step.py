"""One RL update: sample groups from the rollout engine, score them, take one optimiser step on the
token-mean loss (:mod:`openk3.rl.loss`), and sync the new weights into the engine.

Rollout is synchronous (every group of the step runs to the end; on-policy) or, with
``RLConfig.partial``, partial and group-aware (:class:`openk3.rl.partial_rollout.PartialRollout`): the step
trains on the groups that completed, which may include groups started under older policy versions; the
rest resume at the next step. Old tokens are masked or importance-corrected per
``PartialRolloutConfig.old_segments``.

Rewards come from two callables: ``outcome(trajectory) → float`` (one number per rollout, group-normalised
into the advantage) and optionally ``dense(trajectories) → [B, T]`` (a per-token reward added to the
advantage with discount 0, e.g. MOPD). An outcome function that raises drops that rollout (its tokens do
not train), is counted in the statistics and logged (a warning with the first error); training continues. A group with fewer than two surviving
rollouts does not train.

Legend: ``P`` prompts, ``G`` samples per prompt, ``B = P·G`` rollouts, ``T`` response tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from openk3.rl.logprobs import response_logprobs
from openk3.rl.loss import LossConfig, policy_loss
from openk3.rl.partial_rollout import PartialRollout, PartialRolloutConfig, train_mask
from openk3.rl.rollout import RolloutEngine, Trajectory


@dataclass(frozen=True)
class RLConfig:
    group_size: int = 8
    max_tokens: int = 32
    lr: float = 3e-4
    grad_clip: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    partial: PartialRolloutConfig | None = None
    """Partial, group-aware rollout (the engine must be a local :class:`RolloutEngine`); ``None``: synchronous."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (a group of one has no advantage), got {self.group_size}"
            )
        if self.max_tokens < 1 or not self.lr > 0 or not self.grad_clip > 0:
            raise ValueError("max_tokens must be >= 1, lr > 0 and grad_clip > 0")


def masked_group_advantages(rewards_PG: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_PG, keep_PG)``: group-normalised advantages over the finite rewards of each group (NaN marks a
    dropped rollout); groups with fewer than two finite rewards are not kept."""
    keep_PG = torch.isfinite(rewards_PG)
    n_P = keep_PG.sum(1, keepdim=True)
    r_PG = torch.where(keep_PG, rewards_PG, torch.zeros_like(rewards_PG))
    mean_P = r_PG.sum(1, keepdim=True) / n_P.clamp_min(1)
    var_P = (torch.where(keep_PG, r_PG - mean_P, torch.zeros_like(r_PG)) ** 2).sum(
        1, keepdim=True
    ) / n_P.clamp_min(1)
    adv_PG = torch.where(keep_PG, (r_PG - mean_P) / (var_P.sqrt() + eps), torch.zeros_like(r_PG))
    keep_PG = keep_PG & (n_P >= 2)
    return adv_PG, keep_PG


class PolicyTrainer:
    """The trainer's model, its optimiser, and the rollouts it feeds.

    ``engine`` is a :class:`~openk3.rl.rollout.RolloutEngine` in this process, or anything with the same
    ``generate``, ``sync_weights``, ``version``, ``sampling`` and ``sample_vocab_size`` (the Ray actors of
    :mod:`openk3.rl.ray_workers`)."""

    def __init__(self, model: nn.Module, engine: RolloutEngine, config: RLConfig) -> None:
        self.model, self.engine, self.config = model, engine, config
        self.opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.partial = PartialRollout(config.partial) if config.partial is not None else None

    def rollout(
        self, prompts: list[list[int]], metas: list[dict], max_tokens: list[int] | None = None
    ) -> tuple[list[Trajectory], int, dict]:
        """``(trajectories, groups, statistics)``: the complete groups to train on, flattened group by
        group (``G`` each). Synchronous: the groups of ``prompts``; partial: whichever groups completed
        (``prompts`` join the buffer). ``max_tokens`` caps each prompt's responses (default
        ``RLConfig.max_tokens``)."""
        G = self.config.group_size
        caps = max_tokens if max_tokens is not None else [self.config.max_tokens] * len(prompts)
        if len(caps) != len(prompts) or len(metas) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(metas)} metas and {len(caps)} max_tokens")
        groups = [[Trajectory(p, n, dict(m)) for _ in range(G)] for p, m, n in zip(prompts, metas, caps)]
        if self.partial is None:
            trajs = self.engine.generate([t for g in groups for t in g])
            if not all(t.finished for t in trajs):
                raise RuntimeError("synchronous rollout returned unfinished trajectories")
            return trajs, len(groups), {}
        done, st = self.partial.run(self.engine, groups)
        trajs = [t for g in done for t in g]
        stale = sum(v < self.engine.version for t in trajs for v in t.versions)
        return (
            trajs,
            len(done),
            {
                "groups_trained": float(len(done)),
                "groups_paused": float(st.paused),
                "groups_restarted": float(st.dropped_stale),
                "stale_token_fraction": stale / max(1, sum(t.num_generated for t in trajs)),
            },
        )

    def step(
        self,
        prompts: list[list[int]],
        metas: list[dict],
        outcome: Callable[[Trajectory], float],
        dense: Callable[[list[Trajectory]], torch.Tensor] | None = None,
        max_tokens: list[int] | None = None,
    ) -> tuple[dict[str, float], list[Trajectory]]:
        """Roll out ``G`` samples per prompt (:meth:`rollout`), update once on the complete groups, sync;
        returns statistics and the rollouts trained on."""
        G = self.config.group_size
        trajs, P, rollout_stats = self.rollout(prompts, metas, max_tokens)
        if not trajs:
            self.engine.sync_weights(self.model)
            return {
                "reward": float("nan"),
                "length": 0.0,
                "dropped_rollouts": 0.0,
                "dense_reward": 0.0,
                **rollout_stats,
            }, []
        rewards, dropped = [], 0
        for t in trajs:
            try:
                rewards.append(float(outcome(t)))
            except Exception as e:  # a broken reward drops its rollout, never the run
                rewards.append(float("nan"))
                dropped += 1
                if dropped == 1:
                    first_error = f"{type(e).__name__}: {e}"
        if dropped:
            logging.getLogger(__name__).warning(
                "%s of %d rollouts dropped (their outcome raised); the first: %s",
                "all" if dropped == len(trajs) else dropped,
                len(trajs),
                first_error,
            )
        r_PG = torch.tensor(rewards).view(P, G)
        adv_PG, keep_PG = masked_group_advantages(r_PG)
        temperature = self.engine.sampling.temperature or 1.0  # the behaviour log-probs' temperature
        logp_BT, mask_BT = response_logprobs(
            self.model,
            [t.prompt_ids for t in trajs],
            [t.response_ids for t in trajs],
            temperature,
            self.engine.sample_vocab_size,
        )
        T = mask_BT.shape[1]
        behav_BT = torch.zeros_like(logp_BT)
        for b, t in enumerate(trajs):
            behav_BT[b, : t.num_generated] = torch.tensor(t.behaviour_logprobs)
            old = self.config.partial.old_segments if self.config.partial is not None else "correct"
            keep = torch.tensor(train_mask(t, self.engine.version, old)) * torch.tensor(t.loss_mask)
            mask_BT[b, : t.num_generated] *= keep
        mask_BT = mask_BT * keep_PG.reshape(-1, 1).float()
        adv_BT = adv_PG.reshape(-1, 1).expand(-1, T).clone()
        dense_mean = 0.0
        if dense is not None:
            d_BT = dense(trajs)
            adv_BT = adv_BT + d_BT
            dense_mean = float((d_BT * mask_BT).sum() / mask_BT.sum().clamp_min(1))
        stats = {
            "reward": float(torch.nanmean(r_PG)),
            "length": sum(t.num_generated for t in trajs) / len(trajs),
            "dropped_rollouts": float(dropped),
            "dense_reward": dense_mean,
            **rollout_stats,
        }
        if mask_BT.sum() > 0:
            loss, loss_stats = policy_loss(logp_BT, behav_BT, adv_BT, mask_BT, self.config.loss)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.opt.step()
            stats.update(loss=loss.item(), **loss_stats)
        self.engine.sync_weights(self.model)
        return stats, trajs
