"""Pure algorithm functions on tensors: advantages, losses, discrepancy, prefix sampling.

Shapes: G prompt groups of K completions, B = G*K completion rows, T completion positions.
"""
