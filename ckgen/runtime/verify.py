"""Correctness gate: a candidate runs on fresh random inputs with poisoned (NaN) outputs and is
compared with the op's float64 reference, every output, with the op's tolerances per dtype."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..ops.numeric import max_violation
from ..ops.spec import OpSpec, Problem


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str  # worst output and its error relative to the tolerance (<= 1 passes)


def cooperative_launcher(kernel: Any, launch: Any, args: tuple) -> Callable[[], None]:
    """A callable making `launch` of `kernel` (a CuPy RawKernel) with `args` (kernel_args: numpy
    scalars) through cuLaunchCooperativeKernel on the current stream: the driver starts every
    block at once or refuses the grid with an error (a grid barrier never waits on a block that
    cannot start). CuPy's own launch has no cooperative flag for a loaded cubin."""
    import cupy
    from cupy.cuda import driver

    from .dispatch import arg_slots

    buf, kargs = arg_slots(args)  # the slots the dispatcher's launcher fills
    f = kernel.kernel.ptr

    def run() -> None:
        _ = buf  # the argument slots live as long as the launcher
        driver.launchCooperativeKernel(f, *launch.grid, *launch.block, launch.shared_mem,
                                       cupy.cuda.get_current_stream().ptr, kargs.ctypes.data)

    return run


class Harness:
    """One problem's device inputs, its reference outputs, and output buffers to poison."""

    def __init__(self, op: OpSpec, problem: Problem, seed: int | None = None, eps: float = 1e-5,
                 inputs: dict[str, np.ndarray] | None = None):
        import cupy

        self.op, self.problem, self.eps = op, problem, eps
        self.inputs = inputs if inputs is not None else op.make_inputs(problem, np.random.default_rng(seed))
        self.ref = {k: cupy.asarray(v) for k, v in op.reference(problem, self.inputs, eps=eps).items()}
        self.dev_in = {k: cupy.asarray(v) for k, v in op.pack_inputs(problem, self.inputs).items()}
        self.dev_out = {k: cupy.empty(n, dt) for k, (n, dt) in op.output_buffers(problem).items()}

    def runner(self, src: Any, config: Any, target: Any) -> Callable[[], None]:
        """A callable running every launch of `config` (compiled from `src`) on these buffers."""
        import cupy

        from .compile import load_kernel

        ws = cupy.empty(max(self.op.workspace_bytes(self.problem, config), 4), dtype=cupy.uint8)
        z0, nz = self.op.workspace_zeroed(self.problem, config)
        ws[z0:z0 + nz] = 0  # counters the kernels leave at zero: zeroed once, here
        ptrs = {k: a.data.ptr for k, a in {**self.dev_in, **self.dev_out}.items()}
        args = self.op.kernel_args(self.problem, {**ptrs, "ws": ws.data.ptr}, self.eps)
        steps = [(load_kernel(src, target, l.kernel), l) for l in self.op.launches(self.problem, config, target)]

        calls = [cooperative_launcher(k, l, args) if l.cooperative else
                 functools.partial(k, l.grid, l.block, args, shared_mem=l.shared_mem) for k, l in steps]

        def run() -> None:
            _ = ws  # the workspace lives as long as the runner
            for call in calls:
                call()

        return run

    def poison(self) -> None:
        for a in self.dev_out.values():
            a.view("uint8").fill(0xFF)  # all-ones bits: NaN in fp32, fp16 and bf16

    def check(self, run: Callable[[], None], widen: dict[str, float] | None = None) -> Check:
        """Poison, run, compare every output; `widen` multiplies an output's tolerance."""
        import cupy

        self.poison()
        run()
        cupy.cuda.get_current_stream().synchronize()
        got = self.op.unpack_outputs(self.problem, self.dev_out)  # compared on the device
        worst, worst_name = 0.0, ""
        for name, ref in self.ref.items():
            tol = self.op.problem_tolerance(self.problem, name)
            k = (widen or {}).get(name, 1.0)
            v = max_violation(got[name], ref, k * tol.atol, k * tol.rtol)
            if v > worst or not worst_name:
                worst, worst_name = v, name
        ok = worst <= 1.0
        return Check(ok, f"{worst_name}: error {worst:.3g}x tolerance" + ("" if ok else " (unwritten or wrong)"))
