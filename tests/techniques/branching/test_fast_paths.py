"""The DMB single-branch fast path: a call whose tokens all chose one branch (every decoding
step at batch 1) runs that branch's plain matmul, not the grouped path, and gives what the
general grouped path (``fast_paths=False``) gives, down to greedy and beam decoding."""

from __future__ import annotations

import pytest
import torch

from dynaseq.models.search import beam_search, greedy_search
from dynaseq.nn import AuxOutputs
from dynaseq.nn.outputs import MACS_TRACE
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import BranchGroups, dmb_attention, dmb_feedforward, merge_shared_
from dynaseq.techniques.branching.config import DMBConfig

D, H, N = 16, 4, 4


def test_one_branch_stays_in_order_unless_the_general_path_is_forced():
    one = torch.tensor([2])
    same = torch.tensor([1, 1, 1])
    for branch, k in ((one, 2), (same, 1)):
        fast = BranchGroups.of(branch, N)
        assert fast.in_order and fast.only == k and fast.ends is None
        general = BranchGroups.of(branch, N, fast_paths=False)
        assert not general.in_order and general.only is None
        assert general.ends.tolist() == [0] * k + [branch.numel()] * (N - k)
    several = BranchGroups.of(torch.tensor([1, 0, 1]), N)
    assert several.ends is not None and several.only is None


def _pair(make, shared: bool):
    """The same sub-layer (same weights) with and without fast paths, in eval mode; shared
    parts given values (unmerged) or folded in (merged)."""
    torch.manual_seed(0)
    fast, general = make(fast_paths=True).eval(), make(fast_paths=False).eval()
    _randomize_shared(fast)
    general.load_state_dict(fast.state_dict())
    if not shared:
        merge_shared_(fast)
        merge_shared_(general)
    return fast, general


def _randomize_shared(module: torch.nn.Module) -> None:
    """θ_S starts at zero; give it values so that merging has something to fold."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("shared_weight", "shared_bias")):
                p.normal_(std=0.1)


SUBLAYERS = {
    "ffn": lambda fast_paths: dmb_feedforward(D, 32, N, fast_paths=fast_paths),
    "self_attn": lambda fast_paths: dmb_attention(D, H, N, fast_paths=fast_paths),
    "cross_attn": lambda fast_paths: dmb_attention(D, H, N, fast_paths=fast_paths),
}
# (B, T) branch of each token: one token, one branch for all, several branches
ROUTES = {"one_token": [[3]], "one_branch": [[1, 1, 1], [1, 1, 1]],
          "several": [[0, 2, 2], [3, 0, 1]]}


@pytest.mark.parametrize("shared", [False, True], ids=["merged", "unmerged"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", SUBLAYERS)
def test_fast_path_equals_the_general_path(route_to, linear_rows, kind, route, shared):
    fast, general = _pair(SUBLAYERS[kind], shared)
    branch = torch.tensor(ROUTES[route])
    x = torch.randn(*branch.shape, D)
    x = route_to(fast.router, x, branch)
    general.router.load_state_dict(fast.router.state_dict())
    kw = {}
    if kind == "cross_attn":  # the memory tokens take the same branches as the queries
        kw = {"memory": route_to(fast.router, torch.randn(*branch.shape, D), branch)}
    outs, macs, grouped = [], [], []
    for layer in (fast, general):
        aux = AuxOutputs()
        before = linear_rows.grouped_calls
        with torch.no_grad():
            outs.append(layer(x, aux=aux, **kw))
        grouped.append(linear_rows.grouped_calls - before)
        macs.append([rec.macs for rec in aux.traces[MACS_TRACE]])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    assert macs[0] == macs[1]
    if route == "several":
        assert grouped[0] == grouped[1] > 0  # the same grouped path either way
    else:  # one branch: plain matmuls only, where the general path runs grouped ones
        assert grouped[0] == 0 < grouped[1]


def _models(attention: bool = True):
    """An untrained DMB seq2seq with and without fast paths (same weights), eval mode."""
    models = []
    for fast_paths in (True, False):
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=32, ffn_dim=48, n_heads=4, encoder_layers=2,
                          decoder_layers=2,
                          dmb=DMBConfig(attention=attention, fast_paths=fast_paths))
        models.append(build_seq2seq(cfg, 40).eval())
    _randomize_shared(models[0])
    models[1].load_state_dict(models[0].state_dict())
    return models


@pytest.mark.parametrize("merged", [True, False])
def test_decoding_is_the_same_with_and_without_fast_paths(linear_rows, merged):
    fast, general = _models()
    if merged:
        merge_shared_(fast)
        merge_shared_(general)
    gen = torch.Generator().manual_seed(2)
    src = torch.randint(4, 40, (3, 7), generator=gen)
    src[1, 5:] = 0
    kw = {"max_len_a": 0.0, "max_len_b": 8}
    for rows in (src[:1], src):  # batch 1 (every decoder step one token) and a padded batch
        assert greedy_search(fast, rows, **kw) == greedy_search(general, rows, **kw)
        assert beam_search(fast, rows, beam=3, **kw) == beam_search(general, rows, beam=3, **kw)
    linear_rows.grouped_calls = 0
    with torch.no_grad():
        fast.encode(src[:1])  # the 7 source tokens spread over branches: grouped matmuls
    encoder_calls, linear_rows.grouped_calls = linear_rows.grouped_calls, 0
    greedy_search(fast, src[:1], **kw)
    memory_kv = 2 * len(fast.decoder.layers)  # cross-attention K/V of the 7 source tokens
    assert linear_rows.grouped_calls == encoder_calls + memory_kv  # none for a decoder step
