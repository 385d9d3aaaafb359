"""Training with optax: next-byte cross-entropy and one jitted step over the model's parameters.

The step is functional: ``nnx.split`` gives the model's structure (``graphdef``, which holds ``impl``)
and its parameters (an ``nnx.State``, a pytree), optax updates the parameters, and ``nnx.merge``
rebuilds the model. The same code runs on Flax 0.11 and 0.12.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = ["loss_fn", "make_train_step", "train"]


def loss_fn(model, batch, *, impl: str | None = None):
    """Mean next-byte cross-entropy (nats) of ``batch [b, seq + 1]``: position ``t`` predicts ``t + 1``."""
    batch = jnp.asarray(batch)
    logits = model(batch[:, :-1], impl=impl)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_train_step(graphdef, optimizer: optax.GradientTransformation):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(model, batches, steps: int, *, learning_rate: float = 3e-3):
    """Train ``model`` for ``steps`` batches from the iterator ``batches`` with AdamW.

    Returns ``(trained model, losses)`` (a new model; ``model`` is unchanged), ``losses`` a list of floats.
    """
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(learning_rate)
    step = make_train_step(graphdef, optimizer)
    opt_state, losses = optimizer.init(params), []
    for _, batch in zip(range(steps), batches, strict=False):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return nnx.merge(graphdef, params), losses
