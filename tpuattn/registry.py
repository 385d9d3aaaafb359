"""The registry of implementations: one record per implementation, everything else reads it.

An implementation module builds an :class:`Implementation` and calls :func:`register` once.
The record carries what every other layer needs, so no other module names an implementation:
the contract (``fn``, ``supports``), the ``auto`` rule (``auto_rank``, ``priority``), the local
kernel of :mod:`tpuattn.parallel` (``partial``, ``partial_rank``), the bench
(``interpreted_off_tpu``) and the roofline (``schedule``, ``default_blocks``).

:class:`Registry` is the machinery of a contract, written once: :data:`REGISTRY` holds the
attention contract's records, :mod:`tpuattn.decode.registry` the decode contract's. Built-in
implementations are *declared* (name -> module, priority: :meth:`Registry.declare`) and imported on
first use, so importing the package loads no implementation; a module that fails to import leaves
its implementations listed as unavailable, with the import error as the reason, and the others work.

This module imports only the layers below it; the implementations import it (not :mod:`tpuattn.api`),
so there is no import cycle.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import jax

from tpuattn import chips
from tpuattn.errors import TpuattnError, UnavailableImplementation, UnsupportedInput
from tpuattn.options import Options, option_fields, option_names
from tpuattn.spec import AttentionSpec

BACKENDS = ("cpu", "gpu", "tpu")
# The priority of an implementation registered without one (user code): after every built-in.
DEFAULT_PRIORITY = 1000


def _always(*_args) -> bool:
    return True


def _supports_everything(spec: AttentionSpec, backend: str | None = None) -> str | None:
    return None


def _never_auto(spec: AttentionSpec, backend: str) -> float | None:
    return None


_MODEL_MODES = ("fwd", "fwd+bwd")  # tpuattn.measure.flops.MODES (this layer does not import measure/)


@dataclasses.dataclass(frozen=True)
class ScheduleModel:
    """What the compiler showed an implementation's schedule does, for :mod:`tpuattn.model.roofline`.

    Typed, so that a misspelt field is an error (``ScheduleModel(lse_row_byte=4)`` raises
    ``TypeError``) instead of a silently taken default. The defaults are a plain schedule's.

    Attributes:
      live_scores: materialised schedules: ``{mode: f(p) -> bytes}`` per score element live at the
        peak (``p`` = bytes of P; ``mode`` from ``"fwd"``, ``"fwd+bwd"``); ``None`` or a missing mode:
        the model's leanest graph (S in float32, plus P for the backward).
      lse_row_bytes: flash: bytes per query row of the saved logsumexp as the kernel writes it.
      delta_row_bytes: flash: bytes per query row of the backward's delta.
      pads_head_dim: flash: the kernel pads head_dim to the 128 lanes (moves and multiplies the pad).
      pairs_heads: flash: where head_dim is 64 and the kv heads pair, the kernel reads two heads to a
        128-lane tile instead (:class:`tpuattn.pallas.layout.Layout`): it moves the contract's width
        and multiplies the padded one, and a grid step serves both kv heads' query heads.
      kernel_layout_copies: flash: the wrapper copies Q, K, V and O (dO, dQ, dK, dV) to and from
        ``[batch, heads, seq, head_dim]`` around the kernel.
      lse_written_row_bytes: flash: bytes per query row of the logsumexp as the forward kernel writes
        it, where wider than what the backward reads (``None``: ``lse_row_bytes``).
      forward_saves_lse: flash: a forward-only call writes the logsumexp too (splash's forward without
        residuals does not).
      lse_copies_in_backward: flash: buffers the backward makes of the saved logsumexp, each
        ``lse_row_bytes`` a row (0: its passes read the saved one).
      kv_once_per_group: flash: a forward or dQ grid step serves the query heads of a GQA group with
        one K/V block, so K/V are read once per kv head (False: once per query head).
    """

    live_scores: Mapping[str, Callable[[int], float]] | None = None
    lse_row_bytes: int = 4
    delta_row_bytes: int = 4
    pads_head_dim: bool = False
    pairs_heads: bool = False
    kernel_layout_copies: bool = False
    lse_written_row_bytes: int | None = None
    forward_saves_lse: bool = True
    lse_copies_in_backward: int = 0
    kv_once_per_group: bool = False

    def __post_init__(self):
        if self.live_scores is not None:
            unknown = sorted(set(self.live_scores) - set(_MODEL_MODES))
            if unknown or not all(callable(f) for f in self.live_scores.values()):
                raise ValueError(f"live_scores: expected {{mode: f(p) -> bytes}} with modes from "
                                 f"{list(_MODEL_MODES)}, got keys {sorted(self.live_scores)}")
        copies = self.lse_copies_in_backward
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
            raise ValueError(f"lse_copies_in_backward: expected an int >= 0, got {copies!r}")
        for field in ("lse_row_bytes", "delta_row_bytes", "lse_written_row_bytes"):
            value = getattr(self, field)
            if field == "lse_written_row_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field}: expected a positive int (bytes per row), got {value!r}")


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A registered implementation and what it can do.

    Attributes:
      name: the ``impl=`` string.
      fn: ``fn(q, k, v, segment_ids, spec, **options)``: inputs already validated (``segment_ids`` is
        ``None`` or an int32 pair ``(q_ids [batch, q_len], kv_ids [batch, kv_len])``); returns an array
        of q's shape and dtype.
      description: one line for listings.
      available: ``available() -> bool``: can it run on this machine at all (its modules import)?
      supports: ``supports(spec, backend) -> None or a reason``: ``None`` when it serves ``spec`` on
        ``backend`` ("cpu", "gpu", "tpu"), else a sentence saying why not and what to use instead.
      auto_rank: ``auto_rank(spec, backend) -> float or None``: the ``impl="auto"`` preference (lower
        wins); ``None`` keeps it out of the automatic choice.
      interpreted_off_tpu: a Pallas TPU kernel that runs in interpret mode elsewhere (its timings there
        are not kernel speed).
      schedule: the roofline model of its schedule ("materialised", "flash", "flash (row-sum pass)",
        "blockwise (XLA loop)"),
        ``None`` when not modelled.
      default_blocks: ``default_blocks(spec, chip) -> (block_q, block_kv)``: the blocks it runs by
        default on ``chip`` (a chip name; ``None``: the target chip, or this machine), for the model.
      options: the :class:`tpuattn.options.Options` record type ``fn`` reads its options through
        (``PallasOptions``, ...; it reads as the tuple of names it takes); a plain tuple of names from
        a registration of your own.
      model: a :class:`ScheduleModel`: parameters of its schedule's model, read by
        :mod:`tpuattn.model.roofline` (what the compiler showed this implementation does).
      partial: the :class:`PartialOps` that attend one block of a larger problem, or ``None``.
      takes_sinks: ``fn`` takes ``sinks=`` itself (float32 ``[num_q_heads]``, differentiable); an
        implementation with ``partial`` takes them without it (:mod:`tpuattn.sinks` merges the sink).
      partial_rank: ``partial_rank(spec, backend) -> float or None``: the preference (lower wins) as
        the local kernel of :func:`tpuattn.parallel.attention` with ``impl="auto"``; ``None`` keeps it
        out of that automatic choice.
      priority: breaks ties of equal ranks (lower wins), whatever the order of registration; a
        built-in takes the one it is declared with (:meth:`Registry.declare`).
    """

    name: str
    fn: Callable
    description: str
    available: Callable[[], bool] = _always
    supports: Callable[[AttentionSpec, str], str | None] = _supports_everything
    auto_rank: Callable[[AttentionSpec, str], float | None] = _never_auto
    interpreted_off_tpu: bool = False
    schedule: str | None = None
    default_blocks: Callable[[AttentionSpec, str | None], tuple[int, int]] | None = None
    options: type[Options] | tuple[str, ...] = ()
    model: ScheduleModel = dataclasses.field(default_factory=ScheduleModel)
    partial: PartialOps | None = None
    takes_sinks: bool = False
    partial_rank: Callable[[AttentionSpec, str], float | None] = _never_auto
    priority: int = DEFAULT_PRIORITY


@dataclasses.dataclass(frozen=True)
class PartialOps:
    """What an implementation offers to attend one block of a larger problem (ring attention).

    All in the contract layout, float32 results; ``spec`` is a block's spec
    (:func:`tpuattn.spec.block_spec`). The partial state is :class:`tpuattn.softmax.Partial`
    ``(out, m, log_l)``: ``out`` float32 ``[batch, q_len, heads, head_dim]`` normalised by its own
    row sum, ``(m, log_l)`` float32 ``[batch, heads, q_len]``, the row max and the log of the row
    sum of ``exp(s - m)``; a row that sees nothing is ``out = 0``, ``m = -inf``, ``log_l = 0``.
    Blocks' partials combine with :func:`tpuattn.softmax.merge`.

    * ``forward(q, k, v, segment_ids, spec, **options) -> softmax.Partial``: this block's partial
      state (``out`` in float32, not rounded to the input dtype before the merge);
    * ``row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **options) -> delta``: this block's
      share of ``rowsum(P * dP)``, with ``P`` taken from the given (whole-problem) ``(m, log_l)``;
    * ``backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta, **options) -> (dq, dk, dv)``:
      this block's shares of the gradients, from the whole problem's ``(m, log_l)`` and ``delta``.

    Summed over the blocks of a row, the shares are the whole problem's values.
    """

    forward: Callable
    row_sums: Callable
    backward: Callable




# ---------------------------------------------------------------------------- one contract's machinery
log = logging.getLogger("tpuattn")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``impl="auto"`` picks for one problem on one backend, and why."""

    impl: str
    backend: str
    reason: str
    refused: tuple[tuple[str, str], ...]  # (implementation, why it was not picked)
    options: tuple[str, ...] = ()  # the chosen one's options (tpuattn.options_of), old spellings aside

    def __str__(self) -> str:
        return f"{self.impl} on {self.backend}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Subset:
    """The implementations one caller can use, and the record field that ranks them for ``"auto"``.

    ``what`` completes "an implementation that ..." in messages; ``accepts(record) -> bool``;
    ``rank`` names a field like :attr:`Implementation.auto_rank`.
    """

    what: str
    accepts: Callable[[Any], bool]
    rank: str = "auto_rank"


def _never_available() -> bool:
    return False


class Registry(Generic[R]):
    """The implementations of one contract: declared, registered, chosen and resolved.

    ``record_type`` is the contract's record (:class:`Implementation`, or decode's own); it has the
    fields ``name``, ``fn``, ``description``, ``available``, ``supports``, ``auto_rank`` and
    ``priority``. ``noun`` names an implementation in messages ("decode implementation").

    A built-in implementation is declared by name, module and priority (:meth:`declare`); its module
    is imported the first time the implementation is asked for, and registers the record
    (:meth:`register`). A module that raises while importing leaves its implementations listed as
    unavailable, with the error as the reason; the other implementations are unaffected.
    """

    def __init__(self, record_type: type[R], *, noun: str = "implementation"):
        self.record_type = record_type
        self.noun = noun
        self._records: dict[str, R] = {}  # registered (and placeholders of modules that failed)
        self._declared: dict[str, tuple[str, int]] = {}  # name -> (module, priority)
        self._module_errors: dict[str, str] = {}  # module -> why it did not import
        self._why: dict[str, str] = {}  # name -> why it is unavailable (a failed import)

    # ------------------------------------------------------------------ declaring and registering
    def declare(self, name: str, module: str, *, priority: int) -> None:
        """Declare a built-in: ``module`` registers ``name`` when imported, on first use.

        ``priority`` breaks ``auto`` ties (lower wins) instead of the order of registration.
        """
        self._check_name(name)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TpuattnError(f"priority: expected an int, got {priority!r}")
        self._declared[name] = (module, priority)
        record = self._records.get(name)
        if record is not None and record.priority == DEFAULT_PRIORITY and name not in self._why:
            self._records[name] = dataclasses.replace(record, priority=priority)  # registered before declared

    @property
    def _a_noun(self) -> str:
        return ("an " if self.noun[0] in "aeiou" else "a ") + self.noun

    def _check_name(self, name) -> None:
        if not isinstance(name, str) or not name or name == "auto":
            raise TpuattnError(f"name: expected a non-empty string other than 'auto', got {name!r}")

    def register(self, name: str, fn: Callable, *, description: str, replace: bool = False, **fields) -> R:
        """Register ``name``; a second registration raises unless ``replace=True``.

        Without a ``priority`` field a declared built-in takes its declared one, anything else
        :data:`DEFAULT_PRIORITY`.
        """
        self._check_name(name)
        if name in self._records and name not in self._why and not replace:
            raise TpuattnError(f"name: {self._a_noun} named {name!r} is already registered "
                               "(pass replace=True to replace it)")
        fields.setdefault("priority", self._declared.get(name, (None, DEFAULT_PRIORITY))[1])
        if not isinstance(fields["priority"], int) or isinstance(fields["priority"], bool):
            raise TpuattnError(f"priority: expected an int, got {fields['priority']!r}")
        record = self.record_type(name=name, fn=fn, description=description, **fields)
        self._why.pop(name, None)
        self._records[name] = record
        return record

    def unregister(self, name: str) -> None:
        """Remove ``name``, registered or declared (for tests and experiments)."""
        self._records.pop(name, None)
        self._declared.pop(name, None)
        self._why.pop(name, None)

    # ------------------------------------------------------------------ loading
    def _import(self, module: str) -> str | None:
        """Import ``module``; the reason it failed, or None."""
        if module not in self._module_errors:
            try:
                importlib.import_module(module)
            except Exception as error:  # any failure: the implementation is unavailable, not the package
                self._module_errors[module] = f"importing {module} failed: {type(error).__name__}: {error}"
                log.debug("%s", self._module_errors[module])
        return self._module_errors.get(module)

    def get(self, name: str) -> R:
        """The record for ``name``, importing its module on first use.

        An implementation whose module failed to import gets a record that is never available
        (:meth:`unavailable_reason` says why).
        """
        if name in self._records:
            return self._records[name]
        if name not in self._declared:
            raise TpuattnError(f"impl: expected one of {sorted(self.known()) + ['auto']}, got {name!r}")
        module, priority = self._declared[name]
        error = self._import(module)
        if name in self._records:
            return self._records[name]
        why = error or f"{module} imported but registered no {self.noun} named {name!r}"

        def unavailable(*args, **kwargs):
            raise UnavailableImplementation(f"impl: {name!r} is not available: {why}")

        self._records[name] = self.record_type(name=name, fn=unavailable, description=f"unavailable: {why}",
                                               available=_never_available, priority=priority)
        self._why[name] = why
        return self._records[name]

    def known(self) -> tuple[str, ...]:
        """Every name, declared or registered, available here or not; imports nothing."""
        return tuple(self._declared) + tuple(name for name in self._records if name not in self._declared)

    def records(self) -> dict[str, R]:
        """Every record, importing the built-ins not loaded yet (in :meth:`known`'s order)."""
        return {name: self.get(name) for name in self.known()}

    def unavailable_reason(self, name: str) -> str | None:
        """None when ``name`` can run on this machine, else a sentence saying why not."""
        record = self.get(name)
        if name in self._why:
            return f"not available on this machine: {self._why[name]}"
        try:
            if record.available():
                return None
        except Exception as error:
            return f"not available on this machine: its check raised {type(error).__name__}: {error}"
        return "not available on this machine"

    def available(self, subset: Subset | None = None) -> tuple[str, ...]:
        """The names usable on this machine (in ``subset``, if given)."""
        return tuple(name for name, record in self.records().items()
                     if self.unavailable_reason(name) is None and (subset is None or subset.accepts(record)))

    def unavailable(self) -> dict[str, str]:
        """``{name: why}`` for every implementation that cannot run on this machine."""
        reasons = {name: self.unavailable_reason(name) for name in self.records()}
        return {name: why for name, why in reasons.items() if why is not None}

    # ------------------------------------------------------------------ choosing and resolving
    @staticmethod
    def backend(backend: str | None) -> str:
        """``backend``, or the target's (:func:`tpuattn.chips.target_backend`) when None, checked."""
        backend = chips.target_backend() if backend is None else backend
        if backend not in BACKENDS:
            raise TpuattnError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
        return backend

    def choose(self, spec, backend: str | None = None, *, subset: Subset | None = None) -> Choice:
        """The ``impl="auto"`` rule, with its reason and every refusal.

        Each available implementation (in ``subset``, if given) that supports ``spec`` on ``backend``
        offers a rank (``auto_rank``, or the subset's field); the lowest wins, ties going to the
        lower ``priority``, then the name: never the order of registration.
        """
        backend = self.backend(backend)
        rank_field = "auto_rank" if subset is None else subset.rank
        ranked, refused = [], []
        for name, record in self.records().items():
            if subset is not None and not subset.accepts(record):
                refused.append((name, f"not {self._a_noun} that {subset.what}"))
                continue
            why = self.unavailable_reason(name)
            if why is not None:
                refused.append((name, why))
                continue
            reason = record.supports(spec, backend)
            if reason is not None:
                refused.append((name, reason))
                continue
            rank = getattr(record, rank_field)(spec, backend)
            if rank is None:
                refused.append((name, f"not an automatic choice on {backend}"))
                continue
            ranked.append((rank, record.priority, name))
        if not ranked:
            among = "" if subset is None else f" that {subset.what}"
            raise UnsupportedInput(f"impl: no registered {self.noun}{among} supports this input on "
                                   f"{backend}: " + "; ".join(f"{n}: {r}" for n, r in refused))
        ranked.sort()
        (rank, priority, name), rest = ranked[0], ranked[1:]
        label = rank_field.replace("_", " ")
        reason = f"lowest {label} ({rank:g}) among the candidates"
        if rest and rest[0][0] == rank:
            reason += f", priority {priority} breaking the tie"
        if rest:
            reason += "; then " + ", ".join(f"{n} ({r:g})" for r, _, n in rest)
        return Choice(impl=name, backend=backend, reason=reason, refused=tuple(refused),
                      options=option_fields(getattr(self.get(name), "options", ())))

    def resolve(self, impl: str, spec, backend: str | None = None, *, subset: Subset | None = None,
                options=()) -> R:
        """The record that will serve ``spec``: ``impl`` by name, or :meth:`choose`'s for ``"auto"``.

        Raises :class:`~tpuattn.errors.UnavailableImplementation` (with the reason, an import error
        for instance) or :class:`~tpuattn.errors.UnsupportedInput` (with ``supports``' reason, or,
        for ``"auto"``, when the chosen record does not declare every name in ``options``, the
        options the call passes: :meth:`_options_refused`).
        """
        if not isinstance(impl, str):
            raise TpuattnError(f"impl: expected a string, got {impl!r}")
        backend = self.backend(backend)
        if impl == "auto":
            choice = self.choose(spec, backend, subset=subset)
            log.debug("impl='auto' chose %s", choice)
            impl = choice.impl
            self._options_refused(choice, options, subset)
        record = self.get(impl)
        if subset is not None and not subset.accepts(record):
            raise UnsupportedInput(f"impl: expected {self._a_noun} that {subset.what} "
                                   f"(one of {list(self.available(subset))} or 'auto'), got {impl!r}")
        why = self.unavailable_reason(impl)
        if why is not None:
            detail = f" ({self._why[impl]})" if impl in self._why else ""
            raise UnavailableImplementation(
                f"impl: {impl!r} is not available on backend {jax.default_backend()!r}{detail}; "
                f"available here: {list(self.available())}")
        reason = record.supports(spec, backend)
        if reason is not None:
            raise UnsupportedInput(f"impl: {impl!r} does not support this input: {reason}")
        return record

    def _options_refused(self, choice: Choice, options, subset: Subset | None) -> None:
        """Refuse options that ``"auto"``'s choice does not take, naming the choice and the takers.

        Options are one implementation's knobs (``backward=`` is the Pallas kernel's, ``block_q=``
        blockwise's and splash's, each with its own meaning), so they never steer the choice, which
        depends on the input and the backend alone: the same call runs the same kernel whatever
        tuning it passes. A knob the choice does not have is an error that says what was chosen,
        which implementations have the knob, and how to ask for one of them by name.
        """
        own = sorted(option_names(getattr(self.get(choice.impl), "options", ())))
        unknown = sorted(set(options) - set(own))
        if not unknown:
            return
        takers = [name for name in self.available(subset)
                  if set(unknown) <= set(option_names(getattr(self.get(name), "options", ())))]
        it = "it" if len(unknown) == 1 else "them"
        if not takers:
            where = f"no available {self.noun} takes {it if len(unknown) == 1 else 'them all'}"
        elif len(takers) == 1:
            where = f"{takers[0]!r} takes {it}: pass impl={takers[0]!r}"
        else:
            where = f"{', '.join(map(repr, takers))} take {it}: pass impl= one of them"
        raise UnsupportedInput(
            f"impl: 'auto' chose {choice.impl!r} for this input on {choice.backend} ({choice.reason}), "
            f"and {choice.impl!r} takes no option {unknown} (its options: {own}); {where}. impl='auto' "
            f"chooses by the input alone, never by the options")


# ---------------------------------------------------------------------------- the attention contract's
REGISTRY: Registry[Implementation] = Registry(Implementation)
_REGISTRY = REGISTRY._records  # the live records (tests patch entries in and out)


def register(name: str, fn: Callable, *, description: str, replace: bool = False,
             **fields) -> Implementation:
    """Register an implementation under ``name`` (see :class:`Implementation` for ``fields``).

    A second registration of the same name raises unless ``replace=True``.
    """
    return REGISTRY.register(name, fn, description=description, replace=replace, **fields)


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (for tests and experiments)."""
    REGISTRY.unregister(name)


def registered() -> dict[str, Implementation]:
    """Every implementation's record, loading the built-ins not loaded yet."""
    return REGISTRY.records()
