"""Adaptive depth (ALBERTa, Li, Li & Wang, paper 004): a structure predictor reads each input
after a first group of layers and gives it keep probabilities for the layers after that
(RevPC); training scales each layer's residual branches by them, inference stops each row at
the first layer whose probability falls below γ, and the rows that left are not computed.
"""
