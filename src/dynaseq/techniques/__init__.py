"""Techniques that choose computation at run time, one package each, independent of each other:
:mod:`~dynaseq.techniques.cct` (Conditional Computation Transformer, Bapna et al. 2020) and
:mod:`~dynaseq.techniques.branching` (dynamic multi-branch layers and the MoE baseline,
Tan et al. 2021). Each owns its layers, losses and builder; models compose them.
"""
