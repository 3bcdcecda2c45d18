import torch

from dynaseq.nn import KVCache, dense_attention, padding_to_attn_mask


def naive_attention(mha, x, memory=None, mask=None, causal=False):
    """Reference: explicit softmax(QKᵀ/√d)V per head."""
    src = x if memory is None else memory
    b, t, d = x.shape
    h, hd = mha.n_heads, mha.d_head
    q = mha.q_proj(x).view(b, t, h, hd).transpose(1, 2)
    k = mha.k_proj(src).view(b, -1, h, hd).transpose(1, 2)
    v = mha.v_proj(src).view(b, -1, h, hd).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / hd ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        s = k.size(2)
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return mha.out_proj(out.transpose(1, 2).reshape(b, t, d))


def test_matches_naive_with_padding_and_causal():
    torch.manual_seed(0)
    mha = dense_attention(16, 4).eval()
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    mask = padding_to_attn_mask(pad)
    torch.testing.assert_close(mha(x, mem, attn_mask=mask), naive_attention(mha, x, mem, mask))
    torch.testing.assert_close(mha(x, is_causal=True), naive_attention(mha, x, causal=True))


def test_incremental_equals_full_causal():
    torch.manual_seed(0)
    mha = dense_attention(16, 2).eval()
    x = torch.randn(3, 6, 16)
    full = mha(x, is_causal=True)
    cache = KVCache()
    steps = [mha(x[:, i: i + 1], is_causal=True, cache=cache) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full)
    assert cache.length == 6


def test_static_cache_is_computed_once_and_reordered():
    torch.manual_seed(0)
    mha = dense_attention(8, 2).eval()
    x, mem = torch.randn(3, 1, 8), torch.randn(3, 4, 8)
    cache = KVCache(static=True)
    first = mha(x, mem, cache=cache)
    k_before = cache.k
    second = mha(x, mem * 0, cache=cache)  # memory ignored once cached
    torch.testing.assert_close(first, second)
    assert cache.k is k_before
    cache.reorder(torch.tensor([2, 0]))
    torch.testing.assert_close(cache.k, k_before[[2, 0]])


def test_macs_counts():
    mha = dense_attention(16, 4)
    m = mha.macs(n_queries=5, n_keys=7)
    assert m == {"q_proj": 5 * 256, "k_proj": 7 * 256, "v_proj": 7 * 256,
                 "attn_scores": 5 * 7 * 16, "attn_values": 5 * 7 * 16, "out_proj": 5 * 256}
