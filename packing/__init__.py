"""raypack packing."""
from packing.layout import FlatLayout, block_diagonal_causal_mask, flat_layout, slot_mapping  # noqa: F401
from packing.admission import AdmissionConfig, AdmissionController, AdmissionDecision  # noqa: F401
