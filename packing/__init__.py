"""raypack packing: pure algorithms (no torch, no ray; numpy only).

Bin packing, prefix trees and grouping, block hashes and shard keys, group ordering, layouts
and the online admission controller's rule. The names below are the public API.
"""

from packing.admission import AdmissionConfig, AdmissionController, AdmissionDecision
from packing.layout import FlatLayout, block_diagonal_causal_mask, flat_layout, slot_mapping
from packing.prefix import PrefixGroup, group_prefixes, optimal_saving_ratio, saving_ratio

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionDecision",
    "FlatLayout",
    "PrefixGroup",
    "block_diagonal_causal_mask",
    "flat_layout",
    "group_prefixes",
    "optimal_saving_ratio",
    "saving_ratio",
    "slot_mapping",
]
