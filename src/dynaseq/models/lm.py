"""Decoder-only Transformer language model with short per-layer contexts (MicroNet).

Yan et al. 2020 ("MicroNet for Efficient Language Modeling", sec. 3): adaptive input ->
L pre-LayerNorm layers of banded relative-position attention + FFN -> final LayerNorm ->
adaptive softmax. Each layer attends to its last C positions (:mod:`dynaseq.nn.relative_attention`);
a training window holds C_e >= L(C-1)+1 tokens. The layers are pre-norm
(``x + drop(f(LN(x)))``, as the rest of dynaseq) rather than Transformer-XL's post-norm: it
trains without a long warm-up, which matters for the short CPU runs.

The model composes sub-layers it is given (the LM task wires them from its config:
:func:`dynaseq.tasks.lm.model.build_lm`); nothing here reads a config.

Example::

    model = build_lm(LMModelConfig(d_model=128, n_layers=2, context=32), vocab_size=33278)
    out = model(tokens)                       # tokens (B, T) -> out.hidden (B, T, d)
    logp = model.score(tokens, targets)       # (B, T) log p(target_t | tokens_<=t)
    step = model.step(next_tokens, out.state) # (B,) -> step.log_probs (B, V)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dynaseq.nn.adaptive_io import AdaptiveInput, AdaptiveSoftmax
from dynaseq.nn.layers import EncoderLayer
from dynaseq.nn.neural_cache import NeuralCache
from dynaseq.nn.relative_attention import RelativeCache


@dataclass
class LMState:
    """Incremental state: one :class:`RelativeCache` per layer (the last <= C-1 positions)
    and ``position``, the number of tokens consumed so far (information only: the cost of a
    step does not depend on it)."""

    caches: list[RelativeCache]
    position: int = 0

    def detach(self) -> LMState:
        """Stop gradients at the window boundary (training carries state across windows)."""
        return LMState([c.detach() for c in self.caches], self.position)

    def index_select(self, index: Tensor) -> LMState:
        return LMState([c.index_select(index) for c in self.caches], self.position)


@dataclass
class LMOutput:
    """hidden: (B, T, d) final states fed to the softmax; state: for the next call."""

    hidden: Tensor
    state: LMState


@dataclass
class LMStepOutput:
    """One incremental step: log_probs (B, V) of the next word, hidden (B, d), state."""

    log_probs: Tensor
    hidden: Tensor
    state: LMState


class LMLayer(EncoderLayer):
    """Pre-LN layer: ``x + drop(attn(LN x))`` then ``x + drop(ffn(LN x))``. (B, T, d).

    The encoder layer's sub-layers and parameter names; the self-attention is relative and
    banded, and carries its cache (the last C-1 keys/values) from call to call."""

    def forward(self, x: Tensor, cache: RelativeCache | None = None
                ) -> tuple[Tensor, RelativeCache]:
        h, cache = self.self_attn(self.self_attn_norm(x), cache=cache)
        x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ffn_norm(x))), cache


class TransformerLM(nn.Module):
    """Adaptive input -> layers -> LayerNorm -> adaptive softmax.

    Args:
        embed: :class:`AdaptiveInput` (tokens (B, T) -> (B, T, d)).
        layers: :class:`LMLayer` s whose attention is relative and banded with context C.
        softmax: :class:`AdaptiveSoftmax` (``model.softmax``).
        context: C (for information: the layers hold it).
        dropout: on the embeddings.
        cache: an optional :class:`NeuralCache` (``model.cache``): its θ/λ live in the
            state dict; the forward pass does not use it (the loss and the evaluation do).
        hebbian: optional Hebbian-softmax states (``model.hebbian``, from
            :func:`~dynaseq.nn.hebbian.make_adaptive_hebbian`): per-word counts saved with
            the weights, updated after each training step.
    """

    def __init__(self, embed: AdaptiveInput, layers: list[LMLayer], softmax: AdaptiveSoftmax,
                 context: int, dropout: float = 0.0, cache: NeuralCache | None = None,
                 hebbian: nn.ModuleList | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.hebbian = hebbian
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(embed.d_model)
        self.softmax = softmax
        self.context = context
        self.dropout = nn.Dropout(dropout)
        self.vocab_size, self.d_model = softmax.vocab_size, embed.d_model

    def forward(self, tokens: Tensor, state: LMState | None = None) -> LMOutput:
        """tokens (B, T) long, continuing ``state`` if given -> :class:`LMOutput`."""
        x = self.dropout(self.embed(tokens))  # (B, T, d)
        caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, None if state is None else state.caches[i])
            caches.append(cache)
        position = (0 if state is None else state.position) + tokens.size(1)
        return LMOutput(self.norm(x), LMState(caches, position))

    def score(self, tokens: Tensor, targets: Tensor, state: LMState | None = None) -> Tensor:
        """(B, T) log p(targets[:, t] | tokens[:, :t+1]) (float32)."""
        h = self(tokens, state).hidden
        return self.softmax(h.reshape(-1, h.size(-1)), targets.reshape(-1)).view(targets.shape)

    @torch.inference_mode()
    def step(self, tokens: Tensor, state: LMState | None = None) -> LMStepOutput:
        """One token per row: tokens (B,) -> next-word log-probabilities (B, V).

        Uses the per-layer caches in ``state`` (at most C-1 positions each), so the cost
        is the same at position 100 and at position 10,000.
        """
        out = self(tokens.view(-1, 1), state)
        h = out.hidden[:, -1]
        return LMStepOutput(self.softmax.log_prob(h), h, out.state)

    @torch.inference_mode()
    def generate(self, prompt: Tensor, n_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 mix: Callable[[Tensor, Tensor], Tensor] | None = None,
                 stop: Callable[[], bool] | None = None) -> Tensor:
        """Sample ``n_tokens`` words after ``prompt`` (B, P>=1) -> (B, n_tokens).

        ``temperature`` 0 is greedy; ``top_k`` keeps the k likeliest words.
        ``mix(log_probs (B, V), hidden (B, d)) -> (B, V)`` may reshape each distribution
        (e.g. a neural cache). Sampling is one token at a time from the incremental state.
        ``stop()``, asked before each token: True ends the sampling there (fewer words; a
        server's client gone).
        """
        if prompt.dim() != 2 or prompt.size(1) < 1:
            raise ValueError("prompt must be (B, P) with P >= 1")
        out = self(prompt[:, :-1]) if prompt.size(1) > 1 else None
        state = None if out is None else out.state
        last = prompt[:, -1]
        words = []
        for _ in range(n_tokens):
            if stop is not None and stop():
                break
            st = self.step(last, state)
            state = st.state
            logp = st.log_probs if mix is None else mix(st.log_probs, st.hidden)
            last = sample_next(logp, temperature, top_k, generator)
            words.append(last)
        return torch.stack(words, dim=1) if words else prompt.new_zeros(prompt.size(0), 0)


def sample_next(log_probs: Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """(B, V) log-probabilities -> (B,) sampled ids (temperature 0: argmax)."""
    if temperature <= 0:
        return log_probs.argmax(-1)
    # shifted so the best is 0, divided in float64 (which holds any float temperature): a
    # tiny temperature leaves the best at 0 and sends the others to -inf, never NaN
    lp = log_probs.double()
    logits = (lp - lp.max(-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
