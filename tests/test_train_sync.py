"""A training step without needless host syncs or compilations: the host-read audit itself, the trainer's step
audited (two reads per step, none in the model), the compiled decoder layers sharing graphs across layers of
one structure, and the step profiler's phase table."""

from __future__ import annotations

import collections

import pytest
import torch

import openk3
import test_train
from openk3.config import KimiK3Config
from openk3.presets import k3_shaped
from openk3.train.balance import QuantileBalancer
from openk3.train.checkpointing import wrap_decoder_layers
from openk3.train.host_syncs import HostSyncAudit
from openk3.train.optim import build_optimizer
from openk3.train.step import accumulate_gradients, micro_batch_loss
from openk3.train.step_profile import profile_step
from openk3.train.trainer import Trainer
from test_train import small

corpus = test_train.corpus  # the module fixture of test_train


def test_audit_finds_each_kind_of_host_read():
    x = torch.arange(6.0) - 2
    with HostSyncAudit() as audit:
        x.sum().item()
        float(x[0])
        if (x > 0).any():
            pass
        x[x > 0]
        torch.nonzero(x)
        torch.unique(x)
        x.tolist()
        x.cpu()
        x.numpy()
        torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1, 1, 1]))
        torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1, 1, 1]), output_size=7)  # no read: size given
        (x * 2 + 1).exp().sum(0)  # no read
    kinds = collections.Counter(what for what, _ in audit.events)
    assert kinds == {
        "aten::_local_scalar_dense": 3, "aten::index with a boolean mask": 1, "aten::nonzero": 1,
        "aten::_unique2": 1, "Tensor.tolist": 1, "Tensor.cpu": 1, "Tensor.numpy": 1, "aten::repeat_interleave": 1,
    }  # fmt: skip
    assert all(where.endswith(".py:" + where.rsplit(":", 1)[1]) for _, where in audit.events)
    assert {where.rsplit("/", 1)[-1].split(":")[0] for _, where in audit.events} == {"test_train_sync.py"}
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the wrapped methods are restored


def test_audit_of_a_gpu_run_skips_host_tensors():
    x = torch.arange(4.0)
    with HostSyncAudit("cuda") as audit:
        x.sum().item()
        x.tolist()
    assert audit.total() == 0


def test_trainer_step_reads_the_device_twice_and_the_model_never(corpus, tmp_path):
    """The trainer's step reads (loss, gradient norm) once and the balancer's statistics once; the forward and
    backward of the model read nothing. The other reads are of host tensors on every device (the data loader's
    random window starts) or CPU-only paths: the torch KDA chunk path (the Triton op runs on a GPU) and AdamW's
    step counts, which the CPU's foreach AdamW keeps on the host (the GPU's fused AdamW on the device)."""
    trainer = Trainer(small(corpus, tmp_path / "run", steps=3), progress=False)
    try:
        trainer.train_step()
        with HostSyncAudit() as audit:
            trainer.train_step()
    finally:
        trainer.release_lock()
    per_file = collections.Counter(where.rsplit(":", 1)[0] for _, where in audit.events)
    host_or_cpu_only = {"openk3/data/shards.py", "openk3/ops/kda/chunk_intra.py", "openk3/train/optim.py"}
    assert {f: n for f, n in per_file.items() if f not in host_or_cpu_only} == {
        "openk3/train/trainer.py": 1,
        "openk3/train/balance.py": 1,
    }, audit.counts()
    assert all(what == "aten::_local_scalar_dense" for what, where in audit.events if "optim.py" in where)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: the trainer's step on CUDA, audited")
def test_trainer_step_on_the_gpu_reads_the_device_twice(corpus, tmp_path):
    """On CUDA (Triton KDA op, fused AdamW, bf16 autocast) the only device reads of a step are the trainer's and
    the balancer's: nothing is excluded. (``torch.compile`` steps aside under the audit's dispatch mode, so the
    layers run eagerly: the same operators as the compiled graph, with no fewer reads.)"""
    config = small(corpus, tmp_path / "run", steps=3, device="cuda", compile=False)
    trainer = Trainer(config, progress=False)
    try:
        trainer.train_step()
        with HostSyncAudit("cuda") as audit:
            trainer.train_step()
    finally:
        trainer.release_lock()
    per_file = collections.Counter(where.rsplit(":", 1)[0] for _, where in audit.events)
    assert per_file == {"openk3/train/trainer.py": 1, "openk3/train/balance.py": 1}, audit.counts()


def mla_k3(block_size: int) -> KimiK3Config:
    """k3-tiny with every layer MLA (the CPU's KDA path has data-dependent branches; on a GPU KDA is one custom
    op) and AttnRes blocks of ``block_size`` layers."""
    data = k3_shaped(8).to_dict()
    text = data["text_config"]
    L = text["num_hidden_layers"]
    text["linear_attn_config"].update(kda_layers=[], full_attn_layers=list(range(1, L + 1)))
    text["attn_res_block_size"] = block_size
    return KimiK3Config.from_dict(data)


@pytest.mark.slow
def test_compiled_layers_of_one_structure_share_a_graph(monkeypatch):
    """Layers that differ only in their weights and index compile once: the number of graphs equals the number
    of layer structures (dense or MoE, opens an AttnRes block, closed blocks it reads), counted here from the
    config; the routing statistics' first forward after a reset takes no graph of its own."""
    config = mla_k3(block_size=4)
    text = config.text_config
    structures = {
        (text.is_moe_layer(i), i % 4 == 0, sum(1 for j in range(i) if j % 4 == 0))
        for i in range(text.num_hidden_layers)
    }
    assert len(structures) == 4 < text.num_hidden_layers
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = openk3.build_model(config, seed=0)
    wrap_decoder_layers(model, "none", compile=True)
    balancer = QuantileBalancer(model)
    x = torch.randint(0, text.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two steps: the balancer resets the statistics in between
        with torch.autocast("cpu", dtype=torch.bfloat16):  # grouped_mm compiles for bf16 on the CPU
            loss = micro_batch_loss(model, x[:, :-1], x[:, 1:])
        loss.backward()
        balancer.step()
    assert counters["stats"]["unique_graphs"] == len(structures)
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


@pytest.mark.slow
def test_step_profile_phases_cover_the_step():
    """The profiler's phase table on the CPU: every phase of the step appears once, in order, with operators
    and time; the sums add up."""
    config = mla_k3(block_size=2)
    model = openk3.build_model(config, seed=0)
    balancer = QuantileBalancer(model)
    optimizer = build_optimizer(model, lr=1e-3)
    x = torch.randint(0, config.text_config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))

    def step(mark):
        total = accumulate_gradients(
            model, x[:, :-1], x[:, 1:], 2, mark=lambda p: mark(p if p != "end" else "clip")
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        total.tolist()
        mark("balancer")
        balancer.step()
        mark("optimizer")
        optimizer.step()

    prof = profile_step(step, torch.device("cpu"))
    assert [p.name for p in prof.phases] == ["forward", "backward", "clip", "balancer", "optimizer"]
    for p in prof.phases:
        assert p.kernels > 0 and p.launches == p.kernels and 0 < p.busy_s <= p.wall_s, p
    total = prof.total()
    assert total.kernels == sum(p.kernels for p in prof.phases)
    names = {name for name, _, _ in prof.top_kernels}
    assert {"aten::_grouped_mm", "aten::baddbmm"} <= names  # the experts' GEMMs, Newton–Schulz
    assert sum(count for name, count, _ in prof.top_kernels if name == "aten::_grouped_mm") == 2 * 3 * 3 * 7
    lines = prof.markdown()
    assert lines[0].startswith("| phase |") and any(line.startswith("| step |") for line in lines)


def test_step_profile_attributes_gpu_events_to_phases():
    """The CUDA branch of the summary on a hand-made trace: kernels by their start, runtime launches and syncs
    by the host time of the call, the boundary synchronisations not counted, busy time as the union of
    overlapping kernels, the device-side mirrors of record_function ranges not counted as kernels."""
    from types import SimpleNamespace

    from openk3.train.step_profile import BOUNDARY, summarize

    def ev(name, start, end, device="DeviceType.CPU"):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               cpu_parent=None, cpu_children=[])  # fmt: skip

    gpu = "DeviceType.CUDA"
    events = [
        ev("phase:forward", 0, 100), ev("cudaLaunchKernel", 1, 2), ev("cudaLaunchKernel", 3, 4),
        ev("gemm_a", 10, 30, gpu), ev("gemm_a", 20, 40, gpu), ev(BOUNDARY, 90, 100), ev("cudaDeviceSynchronize", 91, 99),
        ev("phase:forward", 10, 40, gpu),  # the device mirror of the phase's range: not a kernel
        ev("phase:optimizer", 100, 200), ev("cudaLaunchKernel", 101, 102), ev("cudaMemcpyAsync", 103, 104),
        ev("cudaStreamSynchronize", 105, 150), ev("adam", 110, 120, gpu), ev(BOUNDARY, 190, 200),
        ev("phase:forward", 200, 300), ev("cudaLaunchKernel", 201, 202), ev("gemm_a", 250, 260, gpu),
        ev("outside", 400, 410, gpu),
    ]  # fmt: skip
    prof = summarize(events, cuda=True)
    fwd, opt = prof.phases
    assert (fwd.name, fwd.wall_s, fwd.busy_s, fwd.kernels, fwd.launches, fwd.syncs) == (
        "forward",
        200e-6,
        40e-6,
        3,
        3,
        0,
    )
    assert (opt.name, opt.wall_s, opt.busy_s, opt.kernels, opt.launches, opt.syncs) == (
        "optimizer",
        100e-6,
        10e-6,
        1,
        2,
        1,
    )
    assert prof.top_kernels[0][:2] == ("gemm_a", 3) and prof.top_kernels[0][2] == pytest.approx(50e-6)


def test_step_profile_counts_inductor_kernels_and_drops_annotation_mirrors():
    """Inductor opens a host range named after each Triton kernel it launches, an operator-kind range (not a
    user annotation), and the kernel then runs under the same name: it is a kernel. A ``record_function``
    range (a user annotation) reappears on the device as its mirror: not a kernel. The real host events'
    flags, as torch's profiler sets them, are checked too (on the CPU)."""
    from types import SimpleNamespace

    from torch.profiler import ProfilerActivity, profile, record_function

    from openk3.train.step_profile import BOUNDARY, summarize

    def ev(name, start, end, device="DeviceType.CPU", annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               cpu_parent=None, cpu_children=[], is_user_annotation=annotation)  # fmt: skip

    gpu = "DeviceType.CUDA"
    events = [
        ev("phase:forward", 0, 100, annotation=True), ev("phase:forward", 5, 95, gpu, annotation=True),
        ev("triton_poi_fused_mul_0", 1, 2), ev("cuLaunchKernel", 1, 2), ev("triton_poi_fused_mul_0", 10, 30, gpu),
        ev("Torch-Compiled Region: 0/0", 1, 3, annotation=True), ev("Torch-Compiled Region: 0/0", 9, 31, gpu),
        ev(BOUNDARY, 90, 100),
    ]  # fmt: skip
    (fwd,) = summarize(events, cuda=True).phases
    assert (fwd.kernels, fwd.launches, fwd.busy_s) == (1, 1, 20e-6)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("phase:x"):
            with torch._C._profiler._RecordFunctionFast("triton_poi_fused_0", (torch.ones(2),), {}):
                pass
    flags = {e.name: e.is_user_annotation for e in prof.events()}
    assert flags["phase:x"] is True and flags["triton_poi_fused_0"] is False
