"""Models composed from dynaseq.nn blocks."""

from dynaseq.models.seq2seq import (
    Decoder,
    DecoderState,
    Encoder,
    EncoderOutput,
    Seq2SeqOutput,
    Seq2SeqTransformer,
    TokenEmbedding,
)

__all__ = [
    "Decoder",
    "DecoderState",
    "Encoder",
    "EncoderOutput",
    "Seq2SeqOutput",
    "Seq2SeqTransformer",
    "TokenEmbedding",
]
