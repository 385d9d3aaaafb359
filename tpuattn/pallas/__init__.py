"""Pallas TPU flash attention (being written)."""
