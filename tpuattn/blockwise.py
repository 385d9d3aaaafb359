"""Placeholder: online softmax in pure JAX (being written)."""
