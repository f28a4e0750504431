"""``Layout.attention``, the one attention entry of every model: causal SDPA, grouped-query, packed documents."""

import torch
import torch.nn.functional as F

from functitan.sharding import Layout


def _qkv(b=2, h=4, kv=2, s=12, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, n, s, d, generator=g) for n in (h, kv, kv))


def test_packed_documents_attend_only_within_themselves_as_each_document_alone():
    q, k, v = _qkv()
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [7] * 12])  # row 0: three documents; row 1: one
    out = Layout().attention(q, k, v, segment_ids=segments)
    for row, bounds in ((0, [(0, 5), (5, 9), (9, 12)]), (1, [(0, 12)])):
        for lo, hi in bounds:  # each document alone, from its own first token: what packing must not change
            alone = F.scaled_dot_product_attention(
                q[row : row + 1, :, lo:hi],
                k[row : row + 1, :, lo:hi],
                v[row : row + 1, :, lo:hi],
                is_causal=True,
                enable_gqa=True,
            )
            torch.testing.assert_close(out[row : row + 1, :, lo:hi], alone, atol=1e-6, rtol=1e-6)


def test_without_documents_it_is_causal_grouped_query_sdpa():
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(Layout().attention(q, k, v), want)
    scaled = Layout().attention(q, k, v, scale=0.5, causal=False)
    torch.testing.assert_close(scaled, F.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=True))
