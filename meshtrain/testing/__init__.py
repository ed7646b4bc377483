"""Testing tools shipped to users: the equivalence harness, its contracts, the SPMD runner of
real gloo ranks and Hypothesis strategies.

Nothing outside ``meshtrain.testing`` and ``tests/`` imports this package (``mt.testing`` is
loaded on first use).

Example::

    from meshtrain.testing import assert_equivalent
    report = assert_equivalent(MyModel, {"dp": 2, "tp": 2}, rules, optimizer="adamw")
"""

from meshtrain.testing.contract import Contract, Reordering, contract_for
from meshtrain.testing.harness import (
    Comparison,
    EquivalenceReport,
    TokenBatches,
    assert_equivalent,
    summed_cross_entropy,
)

__all__ = [
    "Comparison",
    "Contract",
    "EquivalenceReport",
    "Reordering",
    "TokenBatches",
    "assert_equivalent",
    "contract_for",
    "summed_cross_entropy",
]
