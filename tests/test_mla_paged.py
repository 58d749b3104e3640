"""Absorbed MLA decode attention over the paged block pool (``openk3.ops.mla``): the torch path against an
fp64 softmax written from the definition, the Triton kernel (in the interpreter on a CPU, compiled on a GPU)
against it, and the MLA layer's pool path against its gathered-latents path (``PagedLatents``)."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.model.cache import PagedLatents, PagedPool
from openk3.model.mla import MultiheadLatentAttention
from openk3.ops.mla import latent_pool_splits, paged_latent_attention
from openk3.presets import k3_shaped

pytestmark = pytest.mark.usefixtures("one_thread")


def pool_case(B=3, T=2, H=4, C=32, r=16, L=2, bs=4, N=5, lengths=(0, 7, 17), dtype=torch.float64, seed=0):
    """Random queries, new latents and a pool of ``L`` MLA layers whose rows' blocks are scattered (shuffled
    block ids, null block 0 past each row's end)."""
    g = torch.Generator().manual_seed(seed)
    W = C + r
    num_blocks = 1 + B * N
    pages = torch.randn(num_blocks, L * bs * W, generator=g, dtype=torch.float64).to(dtype)
    pages[0] = 0
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).view(B, N)
    lengths_B = torch.tensor(lengths, dtype=torch.int64)
    used = (lengths_B[:, None] + bs - 1) // bs
    table = torch.where(torch.arange(N)[None] < used, ids, 0)
    q_lat = torch.randn(B, T, H, C, generator=g, dtype=torch.float64).to(dtype)
    q_pe = torch.randn(B, T, H, r, generator=g, dtype=torch.float64).to(dtype)
    lat_new = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(dtype)
    kpe_new = torch.randn(B, T, r, generator=g, dtype=torch.float64).to(dtype)
    return q_lat, q_pe, lat_new, kpe_new, pages, table, lengths_B, L, bs


def reference(q_lat, q_pe, lat_new, kpe_new, pages, table, lengths_B, layer, L, bs, scale):
    """fp64, one row at a time: the row's real cached latents, then the new ones (causal), one softmax."""
    B, T, H, C = q_lat.shape
    W = C + q_pe.shape[-1]
    view = pages.double().view(-1, L, bs, W)
    out = []
    for b in range(B):
        n = int(lengths_B[b])
        past = (
            torch.stack([view[table[b, s // bs], layer, s % bs] for s in range(n)])
            if n
            else view.new_zeros(0, W)
        )
        keys = torch.cat([past, torch.cat([lat_new[b], kpe_new[b]], -1).double()])  # [n + T, W]
        s = (torch.einsum("thc,sc->ths", q_lat[b].double(), keys[:, :C])
             + torch.einsum("thr,sr->ths", q_pe[b].double(), keys[:, C:])) * scale  # fmt: skip
        visible = torch.arange(n + T)[None, :] <= n + torch.arange(T)[:, None]  # [T, n + T]
        p = s.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        out.append(torch.einsum("ths,sc->thc", p, keys[:, :C]))
    return torch.stack(out)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("T", [1, 3])
def test_torch_path_equals_the_definition_in_fp64(layer, T):
    """Rows with 0, 7 and 17 cached tokens (one empty, partial last blocks), 5 blocks each: 20 positions in
    42 splits (most of them empty)."""
    case = pool_case(T=T)
    q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, L, bs = case
    got = paged_latent_attention(q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, layer, L, bs, 0.3)
    want = reference(q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, layer, L, bs, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("programs", [3, 12, 300])
def test_splits_merge_to_the_same_result(monkeypatch, programs):
    """1, 4 and 64 splits of three rows of 20 table positions: empty splits (past a row's end, or all of row
    0's) merge away."""
    import openk3.ops.mla.paged as paged

    q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, L, bs = pool_case(T=2)
    want = reference(q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, 1, L, bs, 0.3)
    monkeypatch.setattr(paged, "PROGRAMS", programs)
    got = paged_latent_attention(q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, 1, L, bs, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_splits_follow_the_batch():
    assert [latent_pool_splits(b) for b in (1, 2, 3, 64, 128, 512)] == [64, 64, 42, 2, 1, 1]


def test_interpreter_kernel_equals_the_torch_path():
    """The Triton kernel in the CPU interpreter (fp32, ``ieee`` dots) against the torch path, with two
    splits of a 20-token table and one tile per split."""
    from openk3.ops.mla.triton_pool import latent_pool_attention_triton

    q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, L, bs = pool_case(T=2, dtype=torch.float32)
    for splits in (1, 2):
        o, lse = latent_pool_attention_triton(q_lat, q_pe, pages, table, lengths, 1, L, bs, 0.3, splits)
        o_ref, lse_ref = torch.ops.openk3.latent_pool_attention.default(
            q_lat.double(), q_pe.double(), pages.double(), table, lengths, 1, L, bs, 0.3, 1
        )
        # merge the splits (the same rule as paged_latent_attention) and compare with the one-split reference
        lse_m = torch.logsumexp(lse, 0)
        o_m = ((lse - lse_m).exp().nan_to_num(0.0)[..., None] * o).sum(0)
        torch.testing.assert_close(lse_m.double(), lse_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o_m.double(), o_ref[0], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(lse[:, 0]).all() and (o[:, 0] == 0).all()  # row 0 has no cached token


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernel needs a CUDA GPU")
def test_gpu_kernel_against_the_definition_in_bf16():
    """bf16 as a server runs it: 64 heads of 512 + 64 (K3's MLA shape), 512-token blocks, a 3000-token row."""
    case = pool_case(B=2, T=1, H=64, C=512, r=64, L=3, bs=512, N=8, lengths=(3000, 1), dtype=torch.bfloat16)
    q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, L, bs = case
    want = reference(q_lat, q_pe, lat_new, kpe_new, pages, table, lengths, 2, L, bs, 0.07)
    cuda = [t.cuda() for t in (q_lat, q_pe, lat_new, kpe_new, pages, table, lengths)]
    got = paged_latent_attention(*cuda, 2, L, bs, 0.07)
    assert got.dtype == torch.bfloat16
    err = (got.double().cpu() - want).norm() / want.norm()
    assert err < 1e-2, err


def test_the_layers_pool_path_equals_its_gathered_path():
    """An MLA layer of a k3-shaped model (fp64) given the pool (``PagedPool``) and given the same latents
    gathered and padded (``PagedLatents``, the eager server path) returns the same output and new latents."""
    model = openk3.build_model(k3_shaped(4, vocab_size=64), dtype=torch.float64, seed=0).eval()
    layer = next(m for m in model.modules() if isinstance(m, MultiheadLatentAttention))
    C, r = layer.kv_lora_rank, layer.rope
    B, T, L, bs, N = 2, 2, 1, 4, 3
    g = torch.Generator().manual_seed(1)
    pages = torch.randn(1 + B * N, L * bs * (C + r), generator=g, dtype=torch.float64)
    pages[0] = 0
    table = torch.tensor([[1, 2, 3], [4, 0, 0]])
    lengths = torch.tensor([9, 3])
    x = torch.randn(B, T, layer.kv_a_proj_with_mqa.in_features, generator=g, dtype=torch.float64)
    pool = PagedPool(pages, table, lengths, 0, L, bs)
    view = pages.view(-1, L, bs, C + r)
    S = N * bs
    pos = torch.arange(S)
    mask = pos[None] < lengths[:, None]
    past = view[torch.where(mask, table[:, pos // bs], 0), 0, pos % bs]
    gathered = PagedLatents(past, mask)
    with torch.no_grad():
        want = layer(x, gathered)
        got = layer(x, pool)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pool.new, gathered.new, rtol=0, atol=0)


def test_the_custom_op_passes_opcheck():
    """``torch.library.opcheck``: the fake implementation's shapes, dtypes and strides match the real one's,
    and the op traces under ``torch.compile`` (what the compiled decode step relies on)."""
    q_lat, q_pe, _, _, pages, table, lengths, L, bs = pool_case(T=2, dtype=torch.float32)
    args = (q_lat, q_pe, pages, table, lengths, 1, L, bs, 0.3, 4)
    torch.library.opcheck(torch.ops.openk3.latent_pool_attention.default, args)
