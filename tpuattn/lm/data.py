"""The corpus the package ships (``corpus.txt``: the project's own README prose) as bytes, and random
training windows of it."""

from __future__ import annotations

from importlib import resources

import numpy as np

from tpuattn._checks import positive_int

__all__ = ["batches", "corpus", "decode_bytes", "encode"]


def corpus() -> np.ndarray:
    """The shipped corpus as byte ids, ``uint8 [n]`` (about 24 KB)."""
    return np.frombuffer(resources.files("tpuattn.lm").joinpath("corpus.txt").read_bytes(), np.uint8).copy()


def encode(text: str) -> np.ndarray:
    """``text`` as UTF-8 byte ids, ``int32 [n]``."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode_bytes(ids) -> str:
    """Byte ids back to text (a byte sequence cut inside a character shows as U+FFFD)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def batches(data: np.ndarray, *, batch: int, seq: int, seed: int = 0):
    """Endless ``int32 [batch, seq + 1]`` windows at random offsets of ``data`` (inputs are ``[:, :-1]``,
    targets ``[:, 1:]``), reproducible from ``seed``."""
    batch, seq = positive_int("batch", batch), positive_int("seq", seq)
    data = np.asarray(data)
    if data.ndim != 1 or len(data) <= seq + 1:
        raise ValueError(f"data: expected a 1-D array longer than seq + 1 = {seq + 1}, got shape "
                         f"{data.shape}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
