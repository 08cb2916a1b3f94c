"""GroupNorm backward ops: dx + dgamma/dbeta (`groupnorm_bwd`), dx alone (`groupnorm_bwd_data`),
dgamma/dbeta alone (`groupnorm_bwd_gamma_beta`). One template (groupnorm_bwd.cu.j2) serves all
three; each op is one OpSpec with its own tuning space."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np

from ..types import DTYPES, Config, Launch, Support, Target, Tolerance
from . import gn_vector
from .gn_limits import CLUSTER_MAX, DGB_LAST_MAX, MAX_TILE_CHANNELS, NCHW_STEP_VECTORS, STAGED
from .groupnorm import (GroupNormOp, fusion_name, GroupNormProblem, gn_instance_name, gn_problem_class, gn_run_bytes,
                        grid_barrier_fits, groupnorm_bwd_reference, groupnorm_fwd_reference, nhwc_tile)
from .numeric import from_storage, round_to, to_storage

_INT32_MAX = 2**31 - 1
DGB_CHANNELS, DGB_ROW_LANES = 16, 32  # the dgamma/dbeta fold kernel's block (see the template)


def grid_merged(scheme: str, split: int) -> bool:
    """single_pass/fused with split past a portable cluster: the blocks of a tile merge at a
    grid-wide barrier (`_GroupNormBwd.grid_merge`)."""
    return scheme in ("single_pass", "fused") and split > CLUSTER_MAX


def pow2_at_least(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _regs_per_thread(config: Config) -> int:
    return min(255, 65536 // (config["threads"] * config["min_blocks"]))


def bwd_regs_needed(p: GroupNormProblem, config: Config, scheme: str) -> int:
    """Estimated registers per thread of the backward's kernels (validate and the cost model)."""
    item = DTYPES[p.dtype]["itemsize"]
    vec, items = config["vec_bytes"] // item, config["items"]
    packed = 2 * items * vec * item // 4  # x and dy, `items` vectors each, as loaded
    # single_pass holds x and dy packed; NHWC pipelined (and fused at a grid barrier, which streams
    # as it does) keeps two steps packed; the other streams keep 2 x items x vec fp32 values
    if scheme == "single_pass":
        regs = packed + 40
    elif p.layout == "nhwc" and (scheme == "pipelined" or grid_merged(scheme, config["split"])):
        regs = 2 * packed + 40
    else:
        regs = 2 * items * vec + 40
    return regs + (7 * vec if p.layout == "nhwc" else 0)  # fixed per-channel params, sums, dx coefficients


class _GroupNormBwd(GroupNormOp):
    """What the three backward ops share; subclasses say which outputs they produce."""

    template: ClassVar[str] = "groupnorm_bwd.cu.j2"
    want_dx: ClassVar[bool]
    want_dgb: ClassVar[bool]
    outputs: ClassVar[tuple[str, ...]]

    # ---- configs ----
    def scheme(self, config: Config) -> str:
        return config["scheme"] if self.want_dx else "multi_stage"

    def grid_merge(self, config: Config) -> bool:
        """single_pass/fused with split > 8 (past a portable cluster): the SPLIT blocks of a tile
        merge A/B through the workspace at a grid-wide barrier, every block resident (a
        cooperative launch), and fold dgamma/dbeta in the same kernel after it."""
        return grid_merged(self.scheme(config), config["split"])

    # ---- the cost model's hooks (`OpSpec.model_*`) ----
    def model_family(self) -> str:
        """The three backward ops share their winners as candidates."""
        return "groupnorm_bwd"

    def model_streams(self, p: GroupNormProblem) -> int:
        return 2  # x and dy

    def model_unroll(self, p: GroupNormProblem, config: Config) -> int:
        """ITEMS vectors; NHWC pipelined (and fused at a grid barrier, which streams as it does)
        two steps of them in flight."""
        d = config.as_dict()
        unroll = d["items"]
        if p.layout == "nhwc" and (d.get("scheme") == "pipelined"
                                   or (d.get("scheme") == "fused" and self.grid_merge(config))):
            unroll *= 2
        return unroll

    def regs_used(self, p: GroupNormProblem, config: Config) -> int:
        return bwd_regs_needed(p, config, self.scheme(config))

    def model_split(self, p: GroupNormProblem, config: Config) -> int:
        return config["split"]

    def model_run_bytes(self, p: GroupNormProblem, config: Config) -> int:
        return gn_run_bytes(p, config["groups_per_block"] * p.C // p.G, config["split"])

    def model_reread_bytes(self, p: GroupNormProblem, config: Config) -> int:
        """dx's schemes but single_pass read x and dy again for dx."""
        if self.want_dx and self.scheme(config) != "single_pass":
            return 2 * (p.N * p.C * p.H * p.W * DTYPES[p.dtype]["itemsize"])
        return 0

    def model_slices_per_block(self, p: GroupNormProblem, config: Config) -> int:
        return config["groups_per_block"] if p.layout == "nhwc" else 1

    def chain_steps(self, p: GroupNormProblem, config: Config, narrow_rows: bool = True) -> int:
        """single_pass loads its share in one step; the other schemes stream the sums, then dx
        (NHWC: R pixel rows x ITEMS per step). The NCHW sums go channel by channel in a 2-D tile
        of RR rows x CC threads: a round per RR channels, each ceil(channel / (CC x ITEMS)) steps
        long, where a row is as narrow as sweeps a channel in one step (CC x ITEMS >= H*W/vec)
        since kernel version 2, and was as wide as the channel (CC >= H*W/vec, up to the block)
        before (`narrow_rows=False`). Where a share straddles channels each piece is counted as a
        whole channel's steps, an upper bound within 2x of the walk (tests/test_costmodel_chain.py)."""
        d = config.as_dict()
        item = DTYPES[p.dtype]["itemsize"]
        vec = max(1, d["vec_bytes"] // item)
        threads, items = d["threads"], d["items"]
        Cg, HW = p.C // p.G, p.H * p.W
        split = d["split"]
        if self.scheme(config) == "single_pass":
            return 1
        passes = 2 if self.want_dx else 1  # the sums, then dx
        if p.layout == "nhwc":
            _, rows, share = nhwc_tile(d["groups_per_block"] * Cg, vec, threads, split, HW, "")
            return passes * -(-share // max(1, rows * items))
        hv = max(1, HW // vec)
        share = -(-(Cg * hv) // split)
        dx = -(-share // (threads * items)) if self.want_dx else 0
        if narrow_rows:
            cc = threads if hv >= threads * items else pow2_at_least(-(-hv // items))
        else:
            cc = threads if hv >= threads else pow2_at_least(hv)
        cc = min(cc, threads)
        chans = min(Cg, -(-share // hv) + (1 if share % hv else 0))
        rounds = -(-chans // (threads // cc))
        return rounds * -(-min(hv, share) // (cc * items)) + dx

    def problem_class(self, p: GroupNormProblem) -> tuple[str, str, int]:
        return gn_problem_class(self, p)

    def class_check(self, p: GroupNormProblem, config: Config, target: Target) -> Support:
        """What the dtype, layout, H*W's vector divisors (NCHW) and target rule out
        (`OpSpec.class_check`)."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, items = config["vec_bytes"], config["threads"], config["items"]
        split, scheme = config["split"], self.scheme(config)
        if vb % item:
            return Support.no(f"vec_bytes={vb} is not a whole number of {p.dtype} elements")
        vec = vb // item
        if p.fused:
            return Support.no(f"{fusion_name(p)}: the backward kernels fuse only activation=swish")
        if threads % target.warp_size:
            return Support.no(f"threads={threads} is not a multiple of the warp size {target.warp_size}")
        if scheme not in STAGED and 1 < split <= CLUSTER_MAX and not target.clusters:
            return Support.no(f"{scheme} with split={split} needs thread-block clusters (sm_90+); "
                              f"{target.arch} has none (multi_stage and pipelined split through memory)")
        if bwd_regs_needed(p, config, scheme) > _regs_per_thread(config):
            return Support.no(f"{items}x{vec} values of x and dy per thread exceed the register budget of "
                              f"{_regs_per_thread(config)} at {threads} threads x {config['min_blocks']} blocks/SM")
        if p.layout == "nchw":
            if config["groups_per_block"] != 1:
                return Support.no("groups_per_block > 1 is for NHWC; NCHW slices are contiguous")
            if p.HW % vec:
                return Support.no(f"vector of {vec} does not divide H*W={p.HW}")
        return Support.yes()

    def class_check_many(self, p: GroupNormProblem, k: Mapping[str, np.ndarray], target: Target) -> np.ndarray:
        """`class_check` on arrays of knob values (`OpSpec.class_check_many`): the same tests."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, items, split = k["vec_bytes"], k["threads"], k["items"], k["split"]
        scheme = k["scheme"] if self.want_dx else np.full(len(vb), "multi_stage")
        ok = (vb % item == 0) & (threads % target.warp_size == 0) & (not p.fused)
        staged = (scheme == STAGED[0]) | (scheme == STAGED[1])
        if not target.clusters:
            ok &= staged | ~((split > 1) & (split <= CLUSTER_MAX))
        vec = np.maximum(vb // item, 1)  # where vb < item, ok is already False
        packed = 2 * items * vec * item // 4  # bwd_regs_needed
        merged = ((scheme == "single_pass") | (scheme == "fused")) & (split > CLUSTER_MAX)  # grid_merged
        two_steps = ((scheme == "pipelined") | merged) if p.layout == "nhwc" else np.zeros(len(vb), dtype=bool)
        regs = np.where(scheme == "single_pass", packed + 40,
                        np.where(two_steps, 2 * packed + 40, 2 * items * vec + 40))
        regs += 7 * vec if p.layout == "nhwc" else 0
        ok &= regs <= np.minimum(255, 65536 // (threads * k["min_blocks"]))
        if p.layout == "nchw":
            ok &= (k["groups_per_block"] == 1) & (p.HW % vec == 0)
        return ok

    def shape_check_many(self, p: GroupNormProblem, k: Mapping[str, np.ndarray], target: Target) -> np.ndarray | None:
        """`shape_check` on arrays of knob values `class_check` admits (ckgen/ops/gn_vector.py);
        None for a problem too large for int64 products."""
        return gn_vector.bwd_shape_check_many(self, p, k, target) if gn_vector.fits_int64(p) else None

    def geometry_columns(self, p: GroupNormProblem, k: Mapping[str, np.ndarray], target: Target,
                         narrow_rows: bool = True) -> dict[str, np.ndarray] | None:
        """The cost model's per-config integers on arrays of knob values (ckgen/ops/gn_vector.py)."""
        return gn_vector.bwd_geometry_columns(self, p, k, target, narrow_rows) if gn_vector.fits_int64(p) else None

    def shape_check(self, p: GroupNormProblem, config: Config, target: Target) -> Support:
        """validate's checks of the problem's sizes (`OpSpec.shape_check`)."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, items = config["vec_bytes"], config["threads"], config["items"]
        gpb, split, scheme = config["groups_per_block"], config["split"], self.scheme(config)
        vec = vb // item
        if p.Cg * p.HW // vec > _INT32_MAX:
            return Support.no("one (n, g) slice has over 2^31 vectors; use a wider vector")
        ch = gpb * p.Cg
        if ch > MAX_TILE_CHANNELS:
            return Support.no(f"tile of {ch} channels exceeds {MAX_TILE_CHANNELS} (shared-memory channel sums)")
        if p.layout == "nchw":  # class_check: H*W is a whole number of vectors
            if scheme == "single_pass" and threads * items > NCHW_STEP_VECTORS:
                return Support.no(f"threads*items={threads * items} exceeds {NCHW_STEP_VECTORS} per-vector "
                                  f"partials in shared memory (NCHW)")
            share = -(-(p.Cg * p.HW // vec) // split)
            if scheme == "single_pass" and share > threads * items:
                return Support.no(f"slice share of {share} vectors exceeds threads*items={threads * items}")
            if split > 1 and share < threads // 4:
                return Support.no(f"a split of {split} leaves each block {share} vectors for {threads} threads")
        else:
            if p.G % gpb:
                return Support.no(f"groups_per_block={gpb} does not divide G={p.G}")
            tile, rows, share = nhwc_tile(ch, vec, threads, split, p.HW,
                                          f"the tile's {ch} channels ({gpb} groups x {p.Cg})")
            if not tile:
                return tile
            if scheme == "single_pass" and share > rows * items:
                return Support.no(f"{share} pixels per block exceed rows*items={rows * items}")
        if self._blocks(p, config) > _INT32_MAX or p.N * split * p.C * 2 > _INT32_MAX:
            return Support.no("grid or workspace too large")
        if self.grid_merge(config):
            return grid_barrier_fits(self._blocks(p, config), config, target)
        return Support.yes()

    def dgb_in_dx(self, config: Config) -> bool:
        """pipelined folds dgamma/dbeta in its dx kernel: no `_dgb` kernel (or launch) of their own."""
        return self.want_dx and self.want_dgb and self.scheme(config) == "pipelined"

    def dgb_last(self, config: Config) -> bool:
        """The one-kernel schemes (single_pass, fused) can fold dgamma/dbeta in their only kernel:
        the last block of each channel tile to finish its sums (a ticket counter in the workspace)
        folds the tile's partial rows, where that fold is small (`dgb_ticket`)."""
        return (self.want_dx and self.want_dgb and self.scheme(config) in ("single_pass", "fused")
                and not self.grid_merge(config))

    def dgb_ticket(self, p: GroupNormProblem, config: Config) -> bool:
        """This call folds dgamma/dbeta in its kernel (no `_dgb` launch): a tile's fold of
        N*split rows x groups_per_block*C/G channels is at most DGB_LAST_MAX (the kernel
        makes the same test on its arguments)."""
        return self.dgb_last(config) and p.N * config["split"] * config["groups_per_block"] * p.Cg <= DGB_LAST_MAX

    def seed_configs(self, p: GroupNormProblem, target: Target, num_sms: int, count: int) -> list[Config]:
        """Valid configs a simple model likes: wide vectors, enough blocks to fill the GPU, data read
        once where it fits, and one of each (scheme, split > 1) family first."""
        def score(c: Config) -> float:
            blocks = self._blocks(p, c)
            per_sm = max(1, min(c["min_blocks"], 2048 // c["threads"]))
            fill = min(1.0, blocks / (num_sms * per_sm))
            step = c["threads"] * c["items"] * c["vec_bytes"]
            once = self.scheme(c) == "single_pass"
            return 2.0 * c["vec_bytes"] / 16 + 2.0 * fill + 0.5 * once + (8 << 10 <= step <= 64 << 10)

        valid = sorted((c for c in self.space.enumerate() if self.validate(p, c, target)), key=score, reverse=True)
        return self.families_first(valid, count)

    def seed_family(self, config: Config) -> tuple[str, bool]:
        """The scheme (single_pass, fused, multi_stage, pipelined) and whether the slice is split."""
        return (self.scheme(config), config["split"] > 1)

    def instance_name(self, p: GroupNormProblem, config: Config) -> str:
        return gn_instance_name(self, p, config, self._instance_name)

    def _instance_name(self, p: GroupNormProblem, config: Config) -> str:
        c = config
        act = "_swish" if p.activation == "swish" else ""
        scheme = {"single_pass": "sp", "fused": "fu", "multi_stage": "ms", "pipelined": "pl"}[self.scheme(c)]
        return (f"ckgen_{self.name}_{p.dtype}_{p.layout}{act}_t{c['threads']}_v{c['vec_bytes']}_i{c['items']}"
                f"_g{c['groups_per_block']}_{scheme}_s{c['split']}_m{c['min_blocks']}")

    def render_context(self, p: GroupNormProblem, config: Config, target: Target) -> dict[str, Any]:
        d = DTYPES[p.dtype]
        return dict(config.as_dict(), target=target, dtype=p.dtype, layout=p.layout, activation=p.activation,
                    storage=d["storage"], itemsize=d["itemsize"], vec=config["vec_bytes"] // d["itemsize"],
                    want_dx=self.want_dx, want_dgb=self.want_dgb, scheme=self.scheme(config),
                    dgb_in_dx=self.dgb_in_dx(config), dgb_last=self.dgb_last(config), dgb_last_max=DGB_LAST_MAX,
                    grid_merge=self.grid_merge(config))

    # ---- launches and memory ----
    def main_blocks(self, p: Any, config: Config, target: Target) -> int:
        return self._blocks(p, config)  # the main launch's grid is (_blocks, 1, 1)

    def _blocks(self, p: GroupNormProblem, config: Config) -> int:
        return p.N * (p.G // config["groups_per_block"]) * config["split"]

    def launches(self, p: GroupNormProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        name = self.instance_name(p, config)
        grid, block = (self._blocks(p, config), 1, 1), (config["threads"], 1, 1)
        smem = 2 * 4 * config["groups_per_block"] * p.Cg  # per-channel sums (dynamic shared memory)
        out: list[Launch] = []
        if self.scheme(config) in STAGED:
            out.append(Launch(f"{name}_stats", grid, block, smem))
        if self.want_dx:
            out.append(Launch(name, grid, block, smem, cooperative=self.grid_merge(config)))
        if self.want_dgb and not self.dgb_in_dx(config) and not self.dgb_ticket(p, config) \
                and not self.grid_merge(config):
            out.append(Launch(f"{name}_dgb", (-(-p.C // DGB_CHANNELS), 1, 1), (DGB_CHANNELS * DGB_ROW_LANES, 1, 1)))
        return tuple(out)

    def _ab_floats(self, p: GroupNormProblem, config: Config) -> int:
        multi = self.want_dx and (self.scheme(config) in STAGED or self.grid_merge(config))
        return self._blocks(p, config) * config["groups_per_block"] * 2 if multi else 0

    def workspace_bytes(self, p: GroupNormProblem, config: Config) -> int:
        # (ds, db) partial rows of the dgamma/dbeta fold first, then the A/B partials (staged schemes
        # and the grid merge), then the zeroed counters
        return self._partial_floats(p, config) * 4 + self.workspace_zeroed(p, config)[1]

    def _partial_floats(self, p: GroupNormProblem, config: Config) -> int:
        dgb = p.N * config["split"] * p.C * 2 if self.want_dgb else 0
        return dgb + self._ab_floats(p, config)

    def workspace_zeroed(self, p: GroupNormProblem, config: Config) -> tuple[int, int]:
        # dgb_last: one ticket counter (uint32) per channel tile, after the partial rows; the grid
        # merge: the barrier's counter, after the A/B partials
        if self.grid_merge(config):
            return 4 * self._partial_floats(p, config), 4
        if not self.dgb_last(config):
            return 0, 0
        return 4 * p.N * config["split"] * p.C * 2, 4 * (p.G // config["groups_per_block"])

    arg_names: ClassVar[tuple[str, ...]] = ("x", "dy", "mean", "rstd", "gamma", "beta", "dx", "dgamma", "dbeta", "ws")

    def scalar_args(self, p: GroupNormProblem) -> tuple:
        return np.int32(p.N), np.int32(p.C), np.int32(p.HW), np.int32(p.G)

    def min_bytes(self, p: GroupNormProblem) -> int:
        # read x and dy; write dx (the per-channel outputs are negligible)
        return (3 if self.want_dx else 2) * p.numel * DTYPES[p.dtype]["itemsize"]

    # ---- data ----
    def make_inputs(self, p: GroupNormProblem, rng: np.random.Generator,
                    offset: float = 0.0, eps: float = 1e-5) -> dict[str, np.ndarray]:
        """The forward's x, gamma, beta; mean/rstd as the forward stores them (fp32); dy."""
        inputs = super().make_inputs(p, rng, offset)
        fwd = groupnorm_fwd_reference(inputs["x"], None, None, p.G, eps)
        inputs["mean"] = fwd["mean"].astype(np.float32).astype(np.float64)
        inputs["rstd"] = fwd["rstd"].astype(np.float32).astype(np.float64)
        inputs["dy"] = round_to(rng.standard_normal((p.N, p.C, p.H, p.W)), p.dtype)
        return inputs

    def reference(self, p: GroupNormProblem, inputs: Mapping[str, np.ndarray],
                  eps: float = 1e-5) -> dict[str, np.ndarray]:
        r = groupnorm_bwd_reference(inputs["dy"], inputs["x"], inputs["mean"], inputs["rstd"],
                                    inputs.get("gamma"), p.G, inputs.get("beta"), p.activation)
        return {k: r[k] for k in self.outputs}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        # dx: like the forward's y; dgamma/dbeta: rounding of the result (the sums' fp32
        # accumulation error grows with N*H*W: see problem_tolerance)
        if output == "dx":
            return {"fp32": Tolerance(2e-4, 2e-4), "fp16": Tolerance(4e-3, 4e-3),
                    "bf16": Tolerance(3e-2, 1.6e-2)}[dtype]
        return {"fp32": Tolerance(1e-4, 2e-5), "fp16": Tolerance(1e-3, 2e-3),
                "bf16": Tolerance(8e-3, 1e-2)}[dtype]

    def problem_tolerance(self, p: GroupNormProblem, output: str) -> Tolerance:
        t = self.tolerance(p.dtype, output)
        if output == "dx":
            return t
        # fp32 sums of N*H*W terms of size ~1: the accumulation error bound grows with the count
        count = p.N * p.HW
        return Tolerance(t.atol + 2e-6 * count, t.rtol)

    def pack_inputs(self, p: GroupNormProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        def img(a: np.ndarray) -> np.ndarray:
            a = a if p.layout == "nchw" else np.transpose(a, (0, 2, 3, 1))
            return to_storage(np.ascontiguousarray(a), p.dtype).ravel()

        packed = {"x": img(inputs["x"]), "dy": img(inputs["dy"]),
                  "mean": np.ascontiguousarray(inputs["mean"], dtype=np.float32).ravel(),
                  "rstd": np.ascontiguousarray(inputs["rstd"], dtype=np.float32).ravel()}
        for k in ("gamma", "beta"):
            if inputs.get(k) is not None:
                packed[k] = to_storage(inputs[k], p.dtype)
        return packed

    def output_buffers(self, p: GroupNormProblem) -> dict[str, tuple[int, Any]]:
        bits = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[p.dtype]
        sizes = {"dx": p.numel, "dgamma": p.C, "dbeta": p.C}
        return {k: (sizes[k], bits) for k in self.outputs}

    def unpack_outputs(self, p: GroupNormProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        if "dx" in self.outputs:
            dx = from_storage(raw["dx"], p.dtype)
            out["dx"] = dx.reshape(p.N, p.C, p.H, p.W) if p.layout == "nchw" else \
                dx.reshape(p.N, p.H, p.W, p.C).transpose(0, 3, 1, 2)
        for k in ("dgamma", "dbeta"):
            if k in self.outputs:
                out[k] = from_storage(raw[k], p.dtype)
        return out


    # ---- plug-in hooks: benchmark, sanitizer ----
    def bench_callables(self, p: GroupNormProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """ckgen's backward against aten's native_group_norm_backward (after silu_backward for
        swish), its output mask asking for what this op computes (dx, dgamma/dbeta or all three);
        channels-last: the autograd of F.group_norm for those gradients (the native op takes NCHW
        only)."""
        import torch
        import torch.nn.functional as F


        aten = torch.ops.aten
        x, gamma, beta, fmt = self._bench_inputs(p, device)
        N, C, H, W, G = p.N, p.C, p.H, p.W, p.G
        swish = p.activation == "swish"
        act = "swish" if swish else None
        dy = torch.randn(N, C, H, W, device=device).to(x.dtype).contiguous(memory_format=fmt)
        ypre, mean, rstd = aten.native_group_norm(x.contiguous(), gamma, beta, N, C, H * W, G, 1e-5)
        ypre = ypre.contiguous(memory_format=fmt)
        mean32, rstd32 = mean.float(), rstd.float()
        mask = [self.want_dx, self.want_dgb, self.want_dgb]  # native_group_norm_backward's output mask
        what = "" if self.want_dx and self.want_dgb else f" ({', '.join(self.outputs)})"
        fn = call

        if self.want_dx:
            def ours():
                return fn(dy, x, mean32, rstd32, gamma, G, beta, activation=act)
        else:
            def ours():
                return fn(dy, x, mean32, rstd32, G, gamma, beta, activation=act)

        if p.layout == "nchw":
            def eager():
                g = aten.silu_backward(dy, ypre) if swish else dy
                return aten.native_group_norm_backward(g, x, mean, rstd, gamma, N, C, H * W, G, mask)

            return ours, eager, "native_group_norm_backward" + what
        xr, wr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
        yr = F.group_norm(xr, G, wr, br, 1e-5)
        yr = F.silu(yr) if swish else yr
        wrt = tuple(t for t, want in zip((xr, wr, br), mask) if want)

        def eager_autograd():
            return torch.autograd.grad(yr, wrt, dy, retain_graph=True)

        return ours, eager_autograd, "autograd of F.group_norm" + what


class GroupNormBwd(_GroupNormBwd):
    name: ClassVar[str] = "groupnorm_bwd"
    want_dx, want_dgb = True, True
    outputs = ("dx", "dgamma", "dbeta")


class GroupNormBwdData(_GroupNormBwd):
    name: ClassVar[str] = "groupnorm_bwd_data"
    want_dx, want_dgb = True, False
    outputs = ("dx",)
    sanitize_shape = (2, 40, 5, 11, 8)


class GroupNormBwdGammaBeta(_GroupNormBwd):
    name: ClassVar[str] = "groupnorm_bwd_gamma_beta"
    want_dx, want_dgb = False, True
    outputs = ("dgamma", "dbeta")
    sanitize_shape = (3, 24, 9, 7, 6)
    sanitize_activations = ("none",)
