"""What sharding bought a run: the library's :mod:`fedshard.server.savings` (its end-of-run
line is a default callback of the strategies); fedshard's app also writes it to
``summary.json``'s ``"sharding"`` entry."""

from fedshard.server.savings import (
    forward_flops,
    reference_summary,
    savings_line,
    sharding_savings,
    submodel_at,
)

__all__ = ["forward_flops", "reference_summary", "savings_line", "sharding_savings",
           "submodel_at"]
