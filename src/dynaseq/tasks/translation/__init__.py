"""Machine translation (encoder-decoder): data, loss, BLEU validation and the Translator."""
