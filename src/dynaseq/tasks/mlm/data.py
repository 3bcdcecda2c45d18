"""MLM data: text lines packed into fixed-length blocks, and dynamic BERT masking.

Packing: the lines' subword ids, each line followed by [SEP], form one stream, cut into
pieces of ``block_len - 1`` tokens, each prefixed with [CLS] (the last block padded). Every
block is a full-length input, so no compute is spent on padding.

Masking (Devlin et al. 2019, sec. 3.1 and appendix A.1), applied afresh to every batch
(dynamic masking, as RoBERTa): each ordinary token (not [CLS], [SEP], padding) is chosen
with probability ``mask_prob``; a chosen token becomes [MASK] with probability
``mask_token_prob``, a uniformly random ordinary word with ``random_token_prob``, and stays
itself otherwise. The model is scored at the chosen positions only. The draws come from a
``torch.Generator`` seeded by the caller (the task seeds it from (seed, step, micro-batch)),
so every rank and every resumed run draws the same masks.

Example::

    blocks = pack_blocks(vocab.encode(lines), 128, vocab)      # (N, 128) long
    batch = mask_tokens(blocks[:32], vocab, MaskSpec(), torch.Generator().manual_seed(0))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dynaseq.tasks.encoder.vocab import EncoderVocab


def pack_blocks(lines: list[list[int]], block_len: int, vocab: EncoderVocab) -> Tensor:
    """(N, block_len) long blocks ``[CLS] w w [SEP] w ...`` of the non-empty lines' ids."""
    stream: list[int] = []
    for ids in lines:
        if ids:
            stream.extend(ids)
            stream.append(vocab.sep_id)
    step = block_len - 1
    n = -(-len(stream) // step)
    out = torch.full((n, block_len), vocab.pad_id, dtype=torch.long)
    out[:, 0] = vocab.cls_id
    flat = torch.tensor(stream, dtype=torch.long)
    for i in range(n):
        piece = flat[i * step:(i + 1) * step]
        out[i, 1:1 + piece.numel()] = piece
    return out


@dataclass(frozen=True)
class MaskSpec:
    """BERT's masking rates (see the module doc)."""

    mask_prob: float = 0.15
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1


@dataclass
class MaskedBatch:
    """inputs: (B, S) the masked blocks; select: (B, S) bool, the chosen positions;
    targets: (N,) the original ids at the chosen positions (row-major order)."""

    inputs: Tensor
    select: Tensor
    targets: Tensor

    def shard(self, rank: int, world: int) -> MaskedBatch:
        """This rank's rows (``rank::world``) and their targets, in the same order."""
        owner = self.select.nonzero()[:, 0]  # (N,) the row of each target
        keep = owner % world == rank
        return MaskedBatch(self.inputs[rank::world], self.select[rank::world],
                           self.targets[keep])

    def to(self, device: torch.device) -> MaskedBatch:
        return MaskedBatch(self.inputs.to(device), self.select.to(device),
                           self.targets.to(device))


def mask_tokens(blocks: Tensor, vocab: EncoderVocab, spec: MaskSpec,
                gen: torch.Generator) -> MaskedBatch:
    """Choose and replace tokens of ``blocks`` (B, S) (see the module doc). At least one
    position is chosen whenever the blocks hold an ordinary token."""
    special = torch.zeros(vocab.size, dtype=torch.bool)
    special[vocab.special_ids] = True
    maskable = ~special[blocks]  # (B, S)
    u = torch.rand(blocks.shape, generator=gen)
    select = maskable & (u < spec.mask_prob)
    if not select.any() and maskable.any():  # a tiny batch: score at least one token
        select[maskable.nonzero()[0].unbind()] = True
    action = torch.rand(blocks.shape, generator=gen)
    random_ids = torch.randint(vocab.first_word_id, vocab.size, blocks.shape, generator=gen)
    inputs = blocks.clone()
    to_mask = select & (action < spec.mask_token_prob)
    to_random = select & ~to_mask & (action < spec.mask_token_prob + spec.random_token_prob)
    inputs[to_mask] = vocab.mask_id
    inputs[to_random] = random_ids[to_random]
    return MaskedBatch(inputs, select, blocks[select])
