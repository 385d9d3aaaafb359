"""Native attention paths (being written)."""
