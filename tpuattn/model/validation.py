"""The compiled static estimate (:mod:`tpuattn.measure.estimate`) against every published TPU measurement
(:mod:`tpuattn.model.published`), beside the roofline (:mod:`tpuattn.model.roofline`).

For each run the program it measured is compiled for its chip's JAX device with libtpu's dumps: JAX's
splash kernel for marin's rows, JAX's Pallas ``flash_attention`` for jax-ml/jax#24633 (the kernel that
issue timed), plain XLA softmax attention for the reference rows, and for axlearn's benchmark the two
programs its 2023 source ran (:data:`tpuattn.measure.estimate.AXLEARN_FLASH_CODE`: Pallas
``flash_attention`` with a dense bias; its ``mha_reference`` with the same bias). Nothing here is fitted
to the measured times: the estimate reads the compiler's bundles, the chips' clocks and HBM bandwidths.

``python -m tpuattn.aot --estimate-validate`` prints the table (:func:`main`).
"""

from __future__ import annotations

import dataclasses
import sys

from tpuattn.measure import estimate
from tpuattn.model import published, roofline

GOAL = (0.67, 1.5)  # estimate / measured within this band counts as a hit


@dataclasses.dataclass(frozen=True)
class Row:
    run: published.PublishedRun
    program: str                 # which program was compiled
    estimate_s: float | None     # compiled (static estimate, not run)
    roofline_s: float            # modelled (lower bound)
    kernels: tuple               # (name, seconds) of the estimate's computations, largest first
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.estimate_s is None else self.estimate_s / self.run.seconds

    @property
    def hit(self) -> bool:
        return self.ratio is not None and GOAL[0] <= self.ratio <= GOAL[1]


def program(run: published.PublishedRun) -> tuple[str, str, dict]:
    """``(what, code, weights)``: the child's source for the program ``run`` measured."""
    shape = dict(batch=run.batch, heads=run.heads, seq_len=run.seq_len, head_dim=run.head_dim,
                 dtype=run.dtype)
    if run.source.startswith("apple/axlearn"):  # its 2023 benchmark: a dense bias, Pallas flash_attention
        fields = dict(causal=run.causal, **shape)
        if run.impl == "reference":
            return "axlearn mha_reference, bias", estimate.AXLEARN_REFERENCE_CODE.format(**fields), {}
        code = estimate.AXLEARN_FLASH_CODE.format(block=run.block, backward=run.mode == "fwd+bwd", **fields)
        weights = estimate.EveryKernel(estimate.tile_weights(run.seq_len, run.block, run.causal))
        return f"flash_attention+bias, block {run.block}", code, weights
    if run.impl == "reference":
        precision = "" if run.precision == "default" else ", precision='highest'"
        code = estimate.XLA_CODE.format(causal=run.causal, backward=run.mode == "fwd+bwd",
                                        precision=precision, **shape)
        return "XLA softmax(QK^T)V", code, {}
    if run.source.startswith("jax-ml/jax#24633"):
        code = estimate.FLASH_CODE.format(causal=run.causal, block=run.block, **shape)
        weights = estimate.EveryKernel(estimate.tile_weights(run.seq_len, run.block, run.causal))
        return f"flash_attention, block {run.block}", code, weights
    mask = "sa.CausalMask" if run.causal else "sa.FullMask"
    code = estimate.SPLASH_CODE.format(mask=mask, block=run.block, backward=run.mode == "fwd+bwd", **shape)
    # splash's forward and backward grids share the square problem's tile map; its whole body runs on
    # every visited tile (estimate.splash_weights, as the side-by-side table reads it)
    return f"splash, block {run.block}", code, estimate.splash_weights(run.seq_len, run.block, run.causal)


def validate_run(run: published.PublishedRun) -> Row:
    """One run: its program compiled and estimated, its roofline, its measured time."""
    spec = roofline.problem(run.seq_len, batch=run.batch, heads=run.heads, head_dim=run.head_dim,
                            dtype=run.dtype, causal=run.causal)
    blocks = {} if run.block is None else {"q_block": run.block, "kv_block": run.block}
    bound = roofline.predict(run.impl, spec, run.chip, run.mode, precision=run.precision, **blocks).time_s
    what, code, weights = program(run)
    try:
        result = estimate.estimate(code, run.chip, weights)
    except Exception as error:  # noqa: BLE001 - a compile that fails is reported in the row
        return Row(run, what, None, bound, (), f"{type(error).__name__}: {str(error).splitlines()[-1]}")
    totals: dict[str, float] = {}
    for computation in result.computations:
        totals[computation.name] = totals.get(computation.name, 0.0) + computation.seconds
    kernels = tuple(sorted(totals.items(), key=lambda item: -item[1]))
    return Row(run, what, result.seconds, bound, kernels)


def validate(runs=published.RUNS) -> list[Row]:
    return [validate_run(run) for run in runs]


def table(rows: list[Row]) -> str:
    lines = [f"{'chip':<5}{'run':<22}{'mode':<8}{'T':>6} {'program':<32}{'measured ms':>12}"
             f"{'estimate ms':>12}{'ratio':>7}{'roofline ms':>12}{'ratio':>7}"]
    for row in rows:
        r = row.run
        est = "-" if row.estimate_s is None else f"{row.estimate_s * 1e3:.3f}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        lines.append(f"{r.chip:<5}{r.label[:21]:<22}{r.mode:<8}{r.seq_len:>6} {row.program[:31]:<32}"
                     f"{r.seconds * 1e3:>12.3f}{est:>12}{ratio:>7}{row.roofline_s * 1e3:>12.3f}"
                     f"{row.roofline_s / r.seconds:>7.2f}")
    hits = sum(row.hit for row in rows)
    lines.append(f"{hits} of {len(rows)} within {GOAL[0]}-{GOAL[1]}x of the measured time. estimate: "
                 f"{estimate.LABEL}; roofline: modelled (lower bound); measured: published, on the chip "
                 f"named")
    for row in rows:
        if row.error:
            lines.append(f"  {row.run.chip} {row.run.label}: no estimate ({row.error})")
    return "\n".join(lines)


def main(argv=None) -> list[Row]:
    """``python -m tpuattn.aot --estimate-validate``: the table, with the versions that made it."""
    from tpuattn.measure import aot

    rows = validate()
    print(aot.versions_text())
    print(table(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
