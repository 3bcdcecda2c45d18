"""Masked-language-model pre-training of an encoder (``task: mlm``)."""
