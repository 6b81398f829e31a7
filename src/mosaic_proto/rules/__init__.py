"""Aggregation rules, one class and one file each (as a Flower strategy is a file), and their registry.

A new rule is a subclass of `AggregationRule` (or `FragmentRule`, which hands it each fragment's own and received
values) with a `name`, registered by `register`: a plugin calls it itself, a built-in one is in BUILT_IN below,
registered when the package loads. `Aggregator` (`robust.py`) builds the run's rule from --aggregator by name.
"""

from .clipped import Clipped, clipped_fragment
from .mean import Mean
from .rule import (
    AggregationRule,
    FragmentRule,
    checked_rule_name,
    cut_labels,
    register,
    rule_named,
    rule_names,
    rules_help,
    unregister,
)
from .trimmed_mean import TRIMMED_SHARE, TrimmedMean, trim_count, trimmed_fragment

BUILT_IN = (Mean, TrimmedMean, Clipped)  # in --aggregator's order
for _rule in BUILT_IN:
    register(_rule)

__all__ = [
    "BUILT_IN", "TRIMMED_SHARE", "AggregationRule", "Clipped", "FragmentRule", "Mean", "TrimmedMean",
    "checked_rule_name", "clipped_fragment", "cut_labels", "register", "rule_named", "rule_names", "rules_help",
    "trim_count", "trimmed_fragment", "unregister",
]
