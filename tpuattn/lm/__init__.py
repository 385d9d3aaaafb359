"""A small language model with tpuattn inside: train it, checkpoint it, serve it.

* :mod:`.transformer`: a byte-level decoder-only transformer in Flax NNX (RMSNorm, RoPE, grouped-query
  attention through :func:`tpuattn.attention` with ``impl=`` one argument, a SwiGLU MLP);
* :mod:`.data`: the corpus the package ships (its own README prose) and training windows;
* :mod:`.train`: next-byte cross-entropy and an optax training step;
* :mod:`.serve`: prefill into a paged KV cache, then greedy decoding of many prompts together through
  :func:`tpuattn.decode.attention` with continuous batching (a free list of pages), or mixed batches
  (``chunk=``: prompt chunks beside decoded tokens in one ragged call; ``cache_dtype=`` an int8 or
  float8 cache with :func:`~.serve.calibrate`'d scales), and :func:`~.serve.recompute`, the cache-free
  check.

Needs Flax and optax (``pip install tpuattn[flax]``); importing :mod:`tpuattn` does not import this.
"""

from tpuattn.lm.data import batches, corpus, decode_bytes, encode
from tpuattn.lm.serve import PageAllocator, Served, calibrate, recompute, serve
from tpuattn.lm.train import loss_fn, make_train_step, train
from tpuattn.lm.transformer import VOCAB, Config, PagedCache, Transformer

__all__ = ["VOCAB", "Config", "PageAllocator", "PagedCache", "Served", "Transformer", "batches", "calibrate",
           "corpus", "decode_bytes", "encode", "loss_fn", "make_train_step", "recompute", "serve", "train"]
