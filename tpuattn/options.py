"""Every implementation's options as one typed, frozen record, validated when it is built.

``tpuattn.attention(..., impl=name, **options)`` hands ``options`` to the implementation, which reads
them through its record type (:meth:`Options.parse`): a name it does not declare, or a bad value, is
refused there with the implementation, the option, what was expected and what was given, before
anything is traced. :func:`tpuattn.options_of` lists a record's options; :func:`tpuattn.choose`'s
:class:`~tpuattn.registry.Choice` shows the chosen implementation's.

* :class:`Blocks` -- the block sizes of every tiled implementation (``blockwise``, ``splash``,
  ``pallas``, ``lesson``): the forward's ``block_q`` x ``block_kv`` tile and the backward's
  ``backward_block_q`` x ``backward_block_kv``; ``None`` is the implementation's default. The old
  spellings are still taken, mapped to it: ``block_q=`` / ``block_kv=`` (any tiled implementation) are
  ``blocks=Blocks(block_q=..., block_kv=...)``; pallas's ``block_sizes=`` (an int, a ``BlockSizes`` or a
  ``ForwardBlocks``) is the ``Blocks`` of the same sizes.
* the records: :class:`ReferenceOptions`, :class:`XlaOptions`, :class:`BlockwiseOptions`,
  :class:`SplashOptions`, :class:`PallasOptions`, :class:`TokamaxOptions`, the lesson kernel's
  :class:`LessonOptions` (``impl="lesson"``) (:data:`RECORDS`), and the decode contract's
  :class:`DecodeReferenceOptions`, :class:`DecodeKernelOptions` (its ``pallas``),
  :class:`JaxPagedOptions` and :class:`JaxRaggedOptions` (:data:`DECODE_RECORDS`, listed by
  :func:`tpuattn.decode.options_of`); each checks its own values on construction.
* :func:`option_fields`, :func:`option_names`, :func:`option_descriptions` -- what a registry record's
  ``options`` declaration (a record type, or a plain tuple of names) takes, for both contracts.
* :func:`resolve_interpret` -- the one way ``interpret=`` becomes what ``pallas_call`` takes;
* :func:`scoped_vmem_limit` -- the one rule for a kernel's ``vmem_limit_bytes``.

This module sits beside :mod:`tpuattn.spec` (it imports only the facts below it), so that the
implementations, the registry and the contracts above all read the same records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from tpuattn import chips
from tpuattn._checks import is_int, round_up
from tpuattn.errors import TpuattnError, UnsupportedInput

# The TPU tile: 8 sublanes x 128 lanes of 32-bit values (a vector register).
SUBLANES, LANES = 8, 128
MIB = 1 << 20


# ---------------------------------------------------------------------------- block sizes
@dataclasses.dataclass(frozen=True)
class Blocks:
    """Block sizes of a tiled implementation; ``None`` leaves one to the implementation's default.

    Attributes:
      block_q, block_kv: the forward's tile, query rows x keys.
      backward_block_q, backward_block_kv: the backward's tile (``pallas``: its dQ and dK/dV passes;
        ``splash``: its dQ and dK/dV kernels; ``blockwise`` and ``lesson`` walk the forward's tiles and
        refuse them).

    Every size is a positive int (a Python or NumPy integer, never a bool); which multiples an
    implementation needs is its record's rule (:class:`PallasOptions`, :class:`SplashOptions`,
    :class:`LessonOptions`).
    """

    block_q: int | None = None
    block_kv: int | None = None
    backward_block_q: int | None = None
    backward_block_kv: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if not is_int(value) or value < 1:
                raise TpuattnError(f"blocks.{field.name}: expected a positive int, got {value!r} (or None: "
                                   f"the implementation's default)")
            object.__setattr__(self, field.name, int(value))

    @classmethod
    def uniform(cls, block: int) -> Blocks:
        """Every extent of both passes ``block``."""
        return cls(block, block, block, block)

    @property
    def forward(self) -> tuple[int | None, int | None]:
        return self.block_q, self.block_kv

    @property
    def backward(self) -> tuple[int | None, int | None]:
        return self.backward_block_q, self.backward_block_kv

    def set(self) -> dict[str, int]:
        """The sizes given (not ``None``), by field name."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in given.items() if value is not None}


def as_blocks(name: str, value) -> Blocks | None:
    """``value`` as :class:`Blocks`: ``None``, a ``Blocks``, an int (:meth:`Blocks.uniform`), or an object
    with ``forward`` / ``backward`` tiles or ``block_q`` / ``block_kv`` (pallas's ``BlockSizes`` and
    ``ForwardBlocks``)."""
    if value is None or isinstance(value, Blocks):
        return value
    if is_int(value):
        if value < 1:
            raise TpuattnError(f"{name}: expected a positive int, a Blocks or None, got {value!r}")
        return Blocks.uniform(int(value))
    forward, backward = getattr(value, "forward", None), getattr(value, "backward", None)
    if forward is not None and backward is not None and hasattr(forward, "block_q"):
        return Blocks(forward.block_q, forward.block_kv, backward.block_q, backward.block_kv)
    if hasattr(value, "block_q") and hasattr(value, "block_kv"):
        return Blocks(value.block_q, value.block_kv)
    raise TpuattnError(f"{name}: expected None, a tpuattn.options.Blocks or a positive int (every extent), "
                       f"got {value!r}")


# ---------------------------------------------------------------------------- interpret and VMEM
def resolve_interpret(interpret, impl: str, *, backend: str | None = None, simulate: bool = False) -> Any:
    """The ``interpret`` option -> the value a Pallas kernel is built with, one rule for every kernel.

    * ``None`` (default): compiled for a TPU (the local one, or the chip of :func:`tpuattn.chips.target`),
      Pallas interpret mode (``True``) anywhere else;
    * ``True``: interpret mode; ``False``: compile, refused (``UnsupportedInput``, naming ``impl``) when
      the target is not a TPU, where Pallas would answer only "Only interpret mode is supported";
    * with ``simulate`` (kernels that run in the TPU simulator): ``"simulate"``, the simulator with
      race detection (``pltpu.InterpretParams(detect_races=True)``), or a ``pltpu.InterpretParams``,
      used as given.

    ``backend`` defaults to :func:`tpuattn.chips.target_backend`.
    """
    backend = chips.target_backend() if backend is None else backend
    if interpret is None:
        return backend != "tpu"
    if isinstance(interpret, bool):
        if interpret is False and backend != "tpu":
            raise UnsupportedInput(
                f"interpret: expected True or None (interpret mode) for impl='{impl}' on backend "
                f"{backend!r}: False compiles the Pallas kernel for a TPU, which this target is not "
                f"(compile for one inside tpuattn.chips.target(...)); got False")
        return interpret
    if simulate:
        from jax.experimental.pallas import tpu as pltpu

        if isinstance(interpret, str) and interpret == "simulate":
            return pltpu.InterpretParams(detect_races=True)
        if isinstance(interpret, pltpu.InterpretParams):
            return interpret
        raise TpuattnError(f"interpret: expected None, True, False, 'simulate' or a pltpu.InterpretParams "
                           f"for impl='{impl}', got {interpret!r}")
    raise TpuattnError(f"interpret: expected a bool or None for impl='{impl}', got {interpret!r}")


def _check_interpret(interpret, impl: str, simulate: bool) -> None:
    """Validate an ``interpret`` value without resolving it (the backend is the call's, later)."""
    if interpret is None or isinstance(interpret, bool):
        return
    if simulate and isinstance(interpret, str) and interpret == "simulate":
        return
    if simulate and type(interpret).__name__ == "InterpretParams":
        return
    allowed = ("None, True, False, 'simulate' or a pltpu.InterpretParams" if simulate
               else "a bool or None")
    raise TpuattnError(f"interpret: expected {allowed} for impl='{impl}', got {interpret!r}")


def scoped_vmem_limit(need_bytes: int, margin: float, chip: chips.Chip | None) -> int | None:
    """A Pallas kernel's ``vmem_limit_bytes``, one rule for every kernel.

    ``None`` (the compiler's default scoped limit, ``Chip.kernel_vmem_bytes``) off a known chip or
    while the modelled ``need_bytes`` times ``margin`` (what the compiler asked beyond the model, per
    kernel) fits the default; else that, rounded up to a MiB, at most the chip's VMEM.
    """
    want = int(need_bytes * margin)
    if chip is None or want <= chip.kernel_vmem_bytes:
        return None
    return min(round_up(want, MIB), chip.vmem_bytes)


# ---------------------------------------------------------------------------- the records
class _Declared(type):
    """The metaclass of the records: a record type reads as the tuple of the option names it takes
    (``"backward" in PallasOptions``, ``sorted(record.options)``), as the registry's names did."""

    def __iter__(cls):
        return iter(cls.names())

    def __contains__(cls, name) -> bool:
        return name in cls.names()

    def __len__(cls) -> int:
        return len(cls.names())

    def __bool__(cls) -> bool:  # a class is true, as every class is, whatever its number of options
        return True


class Options(metaclass=_Declared):
    """The base of every record: a frozen dataclass whose fields are the options, ``None`` by default.

    ``IMPL`` names the implementation in messages; ``ALIASES`` maps an old spelling to the field it
    is read into (:meth:`parse`).
    """

    IMPL: ClassVar[str] = "?"
    ALIASES: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        # The base itself is no dataclass: it declares no option (tools such as Sphinx's autodoc ask
        # every class its length).
        return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every keyword the implementation takes: the fields, then the old spellings mapped to them."""
        return cls.fields() + tuple(cls.ALIASES)

    @classmethod
    def describe(cls) -> dict[str, str]:
        """``{option: what it is}``: the fields' types and defaults, and each old spelling's mapping."""
        found = {f.name: f"{f.type} = {f.default!r}" for f in dataclasses.fields(cls)}
        found.update({old: f"old spelling, read as {new}" for old, new in cls.ALIASES.items()})
        return found

    @classmethod
    def parse(cls, options: Mapping[str, Any]):
        """The record of a call's keyword ``options`` (a record of this type is returned as it is).

        Refuses a name the implementation does not take (naming it and the ones it does), and the
        same setting given twice (``blocks=`` with an old spelling of it)."""
        if isinstance(options, cls):
            return options
        options = dict(options)
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise TpuattnError(f"{cls.IMPL}: unknown option(s) {unknown}; expected a subset of "
                               f"{sorted(cls.names())}")
        given = {name: options.pop(name) for name in cls.fields() if name in options}
        cls._read_aliases(given, options)
        return cls(**given)

    @classmethod
    def _read_aliases(cls, given: dict, old: dict) -> None:
        """Map the old spellings left in ``old`` onto ``given`` (block sizes: :class:`Blocks`)."""
        if not old:
            return
        if given.get("blocks") is not None:
            raise TpuattnError(f"{cls.IMPL}: expected block sizes one way, got blocks= and "
                               f"{sorted(old)} (the old spelling of blocks=)")
        sizes = {name: old.pop(name) for name in ("block_q", "block_kv") if name in old}
        if "block_sizes" in old:
            if sizes:
                raise TpuattnError(f"{cls.IMPL}: expected block sizes one way, got block_sizes= and "
                                   f"{sorted(sizes)}")
            given["blocks"] = as_blocks("block_sizes", old.pop("block_sizes"))
        if sizes:
            given["blocks"] = Blocks(**sizes)

    def kwargs(self) -> dict[str, Any]:
        """The options set (not ``None``), by name: what to hand the implementation again."""
        return {name: getattr(self, name) for name in self.fields() if getattr(self, name) is not None}

    # ------------------------------------------------------------------ checks the records share
    def _blocks(self, tiles: Mapping[str, tuple[int, str]] | None) -> None:
        """``blocks`` as :class:`Blocks`; each size a multiple of its tile (``{field: (multiple, why)}``),
        a field absent from ``tiles`` refused (``tiles`` None: every field taken, any size)."""
        blocks = as_blocks("blocks", self.blocks)
        object.__setattr__(self, "blocks", blocks)
        if blocks is None or tiles is None:
            return
        for name, value in blocks.set().items():
            if name not in tiles:
                raise TpuattnError(f"blocks.{name}: expected None for impl='{self.IMPL}' (it takes "
                                   f"{sorted(tiles)}), got {value}")
            multiple, why = tiles[name]
            if value % multiple:
                raise TpuattnError(f"blocks.{name}: expected a multiple of {multiple}, got {value} "
                                   f"(impl='{self.IMPL}': {why})")


_ANY = (1, "")
_LANE_Q = (LANES, "the transposed scores [keys, queries] put queries on the TPU's 128 lanes")
_LANE_KV = (LANES, "the scores [queries, keys] put keys on the TPU's 128 lanes")
_SUBLANE_Q = (SUBLANES, "the scores [queries, keys] put queries on the TPU's 8 sublanes")


@dataclasses.dataclass(frozen=True)
class ReferenceOptions(Options):
    """``impl="reference"`` takes no options."""

    IMPL: ClassVar[str] = "reference"


@dataclasses.dataclass(frozen=True)
class XlaOptions(Options):
    """``impl="xla"``: ``implementation`` is ``jax.nn.dot_product_attention``'s (None: cuDNN on a GPU
    where the case allows it, XLA otherwise)."""

    IMPL: ClassVar[str] = "xla"
    implementation: str | None = None

    def __post_init__(self):
        if self.implementation not in (None, "xla", "cudnn"):
            raise TpuattnError(f"implementation: expected None, 'xla' or 'cudnn' for impl='xla', "
                               f"got {self.implementation!r}")


TOKAMAX_IMPLEMENTATIONS = ("mosaic", "xla", "xla_chunked")


@dataclasses.dataclass(frozen=True)
class TokamaxOptions(Options):
    """``impl="tokamax"``: ``implementation`` is tokamax's (None: ``"mosaic"`` for a TPU, else ``"xla"``)."""

    IMPL: ClassVar[str] = "tokamax"
    implementation: str | None = None

    def __post_init__(self):
        if self.implementation is not None and self.implementation not in TOKAMAX_IMPLEMENTATIONS:
            raise TpuattnError(f"implementation: expected None or one of {list(TOKAMAX_IMPLEMENTATIONS)} "
                               f"for impl='tokamax', got {self.implementation!r}")


@dataclasses.dataclass(frozen=True)
class BlockwiseOptions(Options):
    """``impl="blockwise"``: ``blocks`` (forward ``block_q``, ``block_kv``, any positive sizes; the
    backward walks the forward's tiles, so the backward blocks are refused)."""

    IMPL: ClassVar[str] = "blockwise"
    ALIASES: ClassVar[Mapping[str, str]] = {"block_q": "blocks.block_q", "block_kv": "blocks.block_kv"}
    blocks: Blocks | None = None

    def __post_init__(self):
        self._blocks({"block_q": _ANY, "block_kv": _ANY})


@dataclasses.dataclass(frozen=True)
class SplashOptions(Options):
    """``impl="splash"``: ``blocks`` (multiples of 128: splash's masks tile by the 128 lanes; the
    backward's default is the forward's) and ``interpret`` (None, True or False)."""

    IMPL: ClassVar[str] = "splash"
    ALIASES: ClassVar[Mapping[str, str]] = {"block_q": "blocks.block_q", "block_kv": "blocks.block_kv"}
    blocks: Blocks | None = None
    interpret: bool | None = None

    def __post_init__(self):
        lanes = (LANES, "splash's masks and segment ids tile by the TPU's 128 lanes")
        self._blocks({"block_q": lanes, "block_kv": lanes, "backward_block_q": lanes,
                      "backward_block_kv": lanes})
        _check_interpret(self.interpret, self.IMPL, simulate=False)


PALLAS_BACKWARDS = ("exact", "fast")


@dataclasses.dataclass(frozen=True)
class PallasOptions(Options):
    """``impl="pallas"``: ``blocks`` (forward ``block_q`` a multiple of 8 and ``block_kv`` of 128; the
    backward's both multiples of 128), ``backward`` (``"exact"``, the default, or ``"fast"``) and
    ``interpret`` (None, True, False, ``"simulate"`` or a ``pltpu.InterpretParams``)."""

    IMPL: ClassVar[str] = "pallas"
    ALIASES: ClassVar[Mapping[str, str]] = {"block_q": "blocks.block_q", "block_kv": "blocks.block_kv",
                                            "block_sizes": "blocks"}
    blocks: Blocks | None = None
    backward: str | None = None
    interpret: Any = None

    def __post_init__(self):
        self._blocks({"block_q": _SUBLANE_Q, "block_kv": _LANE_KV, "backward_block_q": _LANE_Q,
                      "backward_block_kv": _LANE_KV})
        if self.backward is not None and self.backward not in PALLAS_BACKWARDS:
            raise TpuattnError(f"backward: expected one of {PALLAS_BACKWARDS} (or None for 'exact') for "
                               f"impl='pallas', got {self.backward!r}")
        _check_interpret(self.interpret, self.IMPL, simulate=True)


@dataclasses.dataclass(frozen=True)
class LessonOptions(Options):
    """``impl="lesson"`` (notebook 03's kernel, :mod:`tpuattn.lesson.flash`): ``blocks`` (forward
    ``block_q`` and ``block_kv``, multiples of 8; the default is 128 rows, or the length rounded up to 8
    if shorter; its dQ and dK/dV kernels walk the forward's tiles, the arrays padded to them, so the
    backward blocks are refused) and ``interpret`` (None, True or False)."""

    IMPL: ClassVar[str] = "lesson"
    ALIASES: ClassVar[Mapping[str, str]] = {"block_q": "blocks.block_q", "block_kv": "blocks.block_kv"}
    blocks: Blocks | None = None
    interpret: bool | None = None

    def __post_init__(self):
        rows = (SUBLANES, "a Q block [block_q, d] and a K/V block [block_kv, d] put their rows on the TPU's "
                          "8 sublanes")
        self._blocks({"block_q": rows, "block_kv": rows})
        _check_interpret(self.interpret, self.IMPL, simulate=False)


_DECODE_KERNEL = "tpuattn.decode.attention(impl='pallas')"


@dataclasses.dataclass(frozen=True)
class DecodeKernelOptions(Options):
    """The decode kernel (``tpuattn.decode``'s ``pallas``, :mod:`tpuattn.decode.kernel`: split-K over
    the cache for a dense q, token-major for a ragged batch): ``block_size`` (a contiguous cache's rows
    per block; a paged cache's block is its page), ``chunk_blocks`` (blocks per split-K chunk, a dense
    q), ``pages_per_step`` (pages one grid step fetches, paged caches), ``q_block`` (a ragged batch's
    flattened tokens per block of the token-major grid), each a positive int, and
    ``interpret`` (None, True or False). Which of them a call may set depends on its cache and its q
    (``block_size`` a contiguous cache, ``pages_per_step`` a paged one, ``q_block`` a ragged batch): the
    kernel checks that against the call's spec."""

    IMPL: ClassVar[str] = "pallas"
    block_size: int | None = None
    chunk_blocks: int | None = None
    pages_per_step: int | None = None
    q_block: int | None = None
    interpret: bool | None = None

    def __post_init__(self):
        for name in ("block_size", "chunk_blocks", "pages_per_step", "q_block"):
            value = getattr(self, name)
            if value is None:
                continue
            if not is_int(value) or value < 1:
                raise TpuattnError(f"{name}: expected None or a positive int for {_DECODE_KERNEL}, "
                                   f"got {value!r}")
            object.__setattr__(self, name, int(value))
        _check_interpret(self.interpret, self.IMPL, simulate=False)


@dataclasses.dataclass(frozen=True)
class DecodeReferenceOptions(Options):
    """``tpuattn.decode.attention(impl="reference")`` takes no options."""

    IMPL: ClassVar[str] = "reference"


@dataclasses.dataclass(frozen=True)
class JaxPagedOptions(Options):
    """``tpuattn.decode.attention(impl="jax_paged")`` (JAX's ``paged_attention``): ``interpret`` (None,
    True or False; off a TPU it runs under JAX's TPU interpreter)."""

    IMPL: ClassVar[str] = "jax_paged"
    interpret: bool | None = None

    def __post_init__(self):
        _check_interpret(self.interpret, self.IMPL, simulate=False)


@dataclasses.dataclass(frozen=True)
class JaxRaggedOptions(JaxPagedOptions):
    """``tpuattn.decode.attention(impl="jax_ragged")`` (JAX's ``ragged_paged_attention``): ``interpret``."""

    IMPL: ClassVar[str] = "jax_ragged"


# The attention contract's records (tpuattn.attention's implementations), and the decode contract's.
RECORDS = (ReferenceOptions, XlaOptions, BlockwiseOptions, SplashOptions, PallasOptions, TokamaxOptions,
           LessonOptions)
DECODE_RECORDS = (DecodeReferenceOptions, DecodeKernelOptions, JaxPagedOptions, JaxRaggedOptions)


def option_fields(options) -> tuple[str, ...]:
    """The options an implementation's ``options`` declaration holds, old spellings left out: a record
    type's fields, or a plain tuple of names."""
    if isinstance(options, type) and issubclass(options, Options):
        return options.fields()
    return tuple(options)


def option_names(options) -> tuple[str, ...]:
    """The keyword names an implementation's ``options`` declaration takes: a record type's
    :meth:`Options.names`, or a plain tuple of names (a record of an older registration)."""
    if isinstance(options, type) and issubclass(options, Options):
        return options.names()
    return tuple(options)


def option_descriptions(options) -> dict[str, str]:
    """``{option: what it is}`` for an implementation's ``options`` declaration: a record type's
    :meth:`Options.describe` (fields with their types and defaults, then the old spellings), or each
    name of a plain tuple ``"declared by name"``; ``{}``: it takes no options."""
    if isinstance(options, type) and issubclass(options, Options):
        return options.describe()
    return {name: "declared by name" for name in options}
