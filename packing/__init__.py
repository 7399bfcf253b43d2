"""raypack packing: pure algorithms (no torch, no ray; numpy only).

Bin packing, prefix trees and grouping, block hashes and shard keys, group ordering, layouts
the online admission controller's rule and the step budget's TPOT controller. The names below are the public API.
"""

from packing.admission import AdmissionConfig, AdmissionController, AdmissionDecision
from packing.bins import pack
from packing.keys import block_hashes, prefix_key
from packing.layout import FlatLayout, block_diagonal_causal_mask, flat_layout, slot_mapping
from packing.ordering import order_groups
from packing.prefix import (
    PrefixGroup,
    group_prefixes,
    one_level_optimal_saving_ratio,
    optimal_saving_ratio,
    prefix_forest,
    saving_ratio,
)
from packing.radix import SortedSequences
from packing.step_budget import StepBudgetConfig, StepBudgetController

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionDecision",
    "FlatLayout",
    "PrefixGroup",
    "SortedSequences",
    "StepBudgetConfig",
    "StepBudgetController",
    "block_diagonal_causal_mask",
    "block_hashes",
    "flat_layout",
    "group_prefixes",
    "one_level_optimal_saving_ratio",
    "optimal_saving_ratio",
    "order_groups",
    "pack",
    "prefix_forest",
    "prefix_key",
    "saving_ratio",
    "slot_mapping",
]
