"""raypack packing."""
from packing.layout import FlatLayout, block_diagonal_causal_mask, flat_layout, slot_mapping  # noqa: F401
