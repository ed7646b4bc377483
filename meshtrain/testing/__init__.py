"""Testing tools shipped to users: the SPMD runner of real gloo ranks and Hypothesis strategies.

Nothing outside ``meshtrain.testing`` and ``tests/`` imports this package.
"""
