"""Sentence (pair) classification and regression with an encoder (``task: classify``)."""
