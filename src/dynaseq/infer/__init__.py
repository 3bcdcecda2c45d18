"""Inference: batched greedy and beam search over cached keys/values, and the Translator."""

from dynaseq.infer.search import beam_search, greedy_search, max_lengths

__all__ = ["beam_search", "greedy_search", "max_lengths"]
