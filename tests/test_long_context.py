"""Long-context rows and the needle eval.

* Rows: exactly ``seq_len + 1`` tokens; the row ends with a copy of its first passage, EOS before each copy;
  batches depend only on ``(seed, step)`` and resume exactly from ``state_dict``.
* Needle eval: an induction oracle (predicts the token that followed the last earlier occurrence of the
  current token pair, written here) scores 1.0 at every length and depth, and a model that always predicts
  one token scores 0, so the scored slice is the needle's copy past its cue.
* ``openk3 train --long-context`` then ``openk3 eval --needle`` run end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openk3.cli import main
from openk3.synthetic.long_context import (
    DEPTHS,
    NEEDLE_CUE,
    PASSAGE_TOKENS,
    LongContextBatches,
    needle_eval,
    needle_rows,
    recall_row,
)

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 0


class _Split:
    """A token split stand-in: distinct ids (so every pair of tokens occurs once), an EOS id, a meta."""

    def __init__(self, n: int = 5000):
        self.tokens_N = np.arange(1, n + 1, dtype=np.int64)
        self.num_tokens, self.eos_id = n, EOS
        self.meta = {"tokenizer_sha256": "x"}

    def _check(self, batch_size, seq_len):
        assert seq_len + 1 <= self.num_tokens


@pytest.mark.parametrize("length", [9, 33, 200, 1025])
def test_recall_row_layout(length):
    row = recall_row(_Split().tokens_N, EOS, length, np.random.default_rng(length))
    m = min(PASSAGE_TOKENS, length // 4)
    assert row.shape == (length,) and row.dtype == np.int64
    assert np.array_equal(row[:m], row[-m:]) and row[m] == EOS and row[-m - 1] == EOS
    assert (row[:m] != EOS).all()


def test_batches_are_seeded_and_resume_exactly():
    a = LongContextBatches(_Split(), 3, 64, seed=5)
    first = [next(a) for _ in range(3)]
    x, y = first[0]
    assert x.shape == y.shape == (3, 64) and torch.equal(x[:, 1:], y[:, :-1])
    b = LongContextBatches(_Split(), 3, 64, seed=5)
    next(b)
    state = b.state_dict()
    c = LongContextBatches(_Split(), 3, 64, seed=0)
    c.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(next(c), first[1]))
    with pytest.raises(ValueError, match="seq_len"):
        LongContextBatches(_Split(), 3, 32).load_state_dict(state)


class _Induction(torch.nn.Module):
    """Next token = the one after the last earlier occurrence of the current (previous, current) pair; its
    ``model`` gives the scores as hidden states, ``lm_head`` passes them on (the shapes the eval feeds it are
    recorded in ``head_inputs``)."""

    def __init__(self):
        super().__init__()
        self.head_inputs = []
        self.lm_head = lambda h: self.head_inputs.append(tuple(h.shape)) or h

    def model(self, ids_BT):
        B, T = ids_BT.shape
        scores = torch.zeros(B, T, 6000)
        for b in range(B):
            seen = {}
            row = ids_BT[b].tolist()
            for t in range(T):
                if t >= 1 and (row[t - 1], row[t]) in seen:
                    scores[b, t, seen[(row[t - 1], row[t])]] = 1
                if t >= 2:
                    seen[(row[t - 2], row[t - 1])] = row[t]
        return scores


class _Constant(torch.nn.Module):
    lm_head = torch.nn.Identity()

    def model(self, ids_BT):
        return torch.zeros(*ids_BT.shape, 6000)


def test_needle_eval_scores_an_oracle_one_and_a_constant_zero():
    split = _Split()
    oracle = needle_eval(_Induction(), split, [40, 300], samples=3)
    assert [(r["length"], r["depth"]) for r in oracle] == [(n, d) for n in (40, 300) for d in DEPTHS]
    assert all(r["accuracy"] == r["token_accuracy"] == 1.0 for r in oracle)
    assert all(r["accuracy"] == r["token_accuracy"] == 0.0 for r in needle_eval(_Constant(), split, [64], 2))


def test_needle_eval_projects_only_the_scored_tokens_a_micro_batch_at_a_time():
    """The full-vocabulary logits of a row of T tokens would be T × V floats: only the needle's scored
    tokens (m − cue = 24 at m = 32) reach the head, ``micro_batch`` rows at a time."""
    oracle = _Induction()
    rows = needle_eval(oracle, _Split(), [1000], samples=6, micro_batch=4)
    assert all(r["accuracy"] == 1.0 for r in rows)
    assert oracle.head_inputs == [
        (4, PASSAGE_TOKENS - NEEDLE_CUE, 6000),
        (2, PASSAGE_TOKENS - NEEDLE_CUE, 6000),
    ] * len(DEPTHS)


def test_needle_longer_than_the_val_split_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as error:
        needle_eval(_Constant(), _Split(500), [256, 600])
    assert "--needle 600" in str(error.value) and "holds 500 tokens" in str(error.value)


def test_needle_refuses_the_flags_it_does_not_use(capsys):
    args = ["eval", "--ckpt", "absent-run", "--needle", "64"]
    assert main([*args, "--seq-len", "64", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "openk3: error: --seq-len, --batch-size are not used by --needle (its rows have the --needle lengths, "
        "a fixed count each): leave them out"
    )


def test_long_context_refuses_a_short_schedule_before_any_data_work(tmp_path, capsys):
    args = ["train", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "run"), "--long-context"]
    assert main([*args, "--context-schedule", "0:4"]) == 2
    err = capsys.readouterr().err
    assert "--context-schedule" in err and "0:4" in err and "need every length >= 8" in err


@pytest.mark.slow  # ~70 s: trains a tokenizer and k3-tiny for 2 steps
def test_cli_long_context_train_then_needle_eval(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}: " + "the quick brown fox jumps over it. " * 60)
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(out), "--steps", "2", "--batch-size", "2"]
    args += ["--context-schedule", "0:64", "--eval-every", "2", "--no-sample", "--long-context"]
    assert main(args) == 0
    assert '"long_context": true' in (out / "train_config.json").read_text()
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(out), "--needle", "64,128"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 * len(DEPTHS) and lines[0].startswith("needle at     64 tokens, depth 0.00")


def test_needle_eval_of_a_real_model_matches_its_full_logits():
    """k3-tiny at random init: the logits the eval computes (scored positions only, 4 rows at a time) equal the
    model's whole logits at those positions (all rows at once), and the accuracies are their argmax's."""
    import openk3

    model = openk3.build_model(openk3.get_preset("k3-tiny"), seed=0).eval()
    head = model.language_model.lm_head
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(out))
    split = _Split(3000)
    split.tokens_N = (split.tokens_N * 7919) % (head.out_features - 1) + 1  # in range, no EOS
    length = 96
    rows = needle_eval(model, split, [length], samples=6, micro_batch=4)
    eval_logits = [torch.cat(seen[2 * i : 2 * i + 2]) for i in range(len(DEPTHS))]
    assert len(seen) == 2 * len(DEPTHS)
    for row, logits_BMV in zip(rows, eval_logits):
        rng = np.random.default_rng([0, length, round(row["depth"] * 100)])
        rows_BT, m = needle_rows(split.tokens_N, EOS, length, row["depth"], 6, rng)
        tokens_BT, scored = torch.from_numpy(rows_BT), slice(length - m + NEEDLE_CUE - 1, length - 1)
        seen.clear()
        with torch.no_grad():
            full_BTV = model(tokens_BT[:, :-1]).logits
        torch.testing.assert_close(logits_BMV, full_BTV[:, scored], rtol=1e-4, atol=1e-4)
        hit_BM = full_BTV[:, scored].argmax(-1) == tokens_BT[:, scored.start + 1 :]
        assert row["token_accuracy"] == float(hit_BM.float().mean())
        assert row["accuracy"] == float(hit_BM.all(-1).float().mean())
