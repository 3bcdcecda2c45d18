"""Adaptive-computation techniques built from :mod:`dynaseq.nn` blocks.

Import from the technique's module: CCT (conditional computation, Bapna et al. 2020) is
:mod:`dynaseq.adaptive.cct`, which re-exports its pieces.
"""
