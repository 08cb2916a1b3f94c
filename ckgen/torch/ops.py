"""ckgen's public ops as PyTorch custom ops: `torch.ops.ckgen.<op>`.

Every op mirrors the ckgen function of the same name (argument order, defaults, outputs):

    ckgen::groupnorm_fwd(x, gamma?, beta?, groups, eps=1e-5, activation="none") -> (y, mean, rstd)
    ckgen::groupnorm_fwd_fused(x, gamma?, beta?, groups, eps=1e-5, activation="none", residual?=None,
        bias_nc?=None) -> (y, mean, rstd): act(GN(x + bias_nc[n, c]) * gamma + beta + residual), activation
        none, swish, relu, gelu or gelu_tanh; its backward is composed (the activation's derivative,
        then groupnorm_bwd)
    ckgen::groupnorm_bwd(dy, x, mean, rstd, gamma?, groups, beta?=None, activation="none") -> (dx, dgamma, dbeta)
    ckgen::groupnorm_bwd_data(dy, x, mean, rstd, gamma?, groups, beta?=None, activation="none") -> dx
    ckgen::groupnorm_bwd_gamma_beta(dy, x, mean, rstd, groups, gamma?=None, beta?=None, activation="none")
        -> (dgamma, dbeta)
    ckgen::maxpool2d_fwd(x, kernel_size, stride, padding, dilation, ceil_mode) -> y
    ckgen::maxpool2d_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode) -> (y, indices)
    ckgen::maxpool2d_bwd(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices?) -> dx
    ckgen::avgpool2d_fwd(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override?) -> y
    ckgen::avgpool2d_bwd(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override?)
        -> dx

Pooling params are int pairs here (the Python wrappers in `ckgen.torch.functional` take ints too);
`activation` is "none" or "swish". `maxpool2d_fwd(..., return_indices=True)` is its own op,
`maxpool2d_fwd_with_indices`, so that every op has a fixed number of outputs.

Kernels:
- CUDA: the ckgen op (zero-copy, torch's current stream). A problem that ckgen's dispatcher
  cannot serve (no config of the tuning space runs it, e.g. more than 2048 channels per group
  in channels-last), or a GPU ckgen cannot use (CuPy missing), runs the PyTorch computation
  below instead, logged once with the reason (`fallbacks()` lists them).
- CPU: the PyTorch computation (float32 math, same outputs, layouts and dtypes). It is what
  lets the fake kernels, autograd formulas and `torch.library.opcheck` be tested without a GPU;
  the modules in `ckgen.torch` run nn's own op on CPU tensors instead.
- Fake (meta): output shapes, strides and dtypes exactly as the real op returns them: outputs
  shaped like x are torch.empty_like(x) (x's strides), the others take x's layout
  (NCHW-contiguous, else channels-last); float32 (N, G) mean/rstd, int64 indices.

Strides: every op takes 4-D tensors of any strides (slices, crops, expands, transposed views).
x runs as it is when it is NCHW-contiguous or channels-last, else as a copy in the nearer of the
two (`dense`), which the outputs then have; dy and indices are brought to x's layout, the
vectors made contiguous. The real and fake kernels do the same, so torch.compile's graphs agree
with the run. The ops carry the `needs_exact_strides` tag (where torch has it), so Inductor
hands them the traced strides (those of eager) rather than a layout of its choosing, and the
copy happens only for what eager code would pass strided too.

Autograd (`register_autograd`): groupnorm_fwd saves x, gamma, mean and rstd (and beta with
swish: the backward kernels recompute the swish input from them); max pooling saves x, plus the
indices for `maxpool2d_fwd_with_indices` (else the backward recomputes the argmax from x); avg
pooling saves nothing. mean, rstd and indices are not differentiable. The backward ops have no
backward: a double backward raises `DoubleBackwardError`.
"""
# No `from __future__ import annotations`: the schema is inferred from the real type hints.
import logging
import threading
from typing import List, Optional  # typing.List: infer_schema reads it on every torch since 2.4

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("ckgen")

NAMESPACE = "ckgen"
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class DoubleBackwardError(RuntimeError):
    """A gradient of a ckgen backward was asked for (create_graph=True, then backward again)."""


# ---------------------------------------------------------------------------------------------
# Op definition: torch.library.define + impl, not torch.library.custom_op
# ---------------------------------------------------------------------------------------------
_LIB = torch.library.Library(NAMESPACE, "DEF")


KERNEL = "kernel"  # the overload that traced graphs call (see _Op)
# needs_exact_strides: Inductor passes the ops tensors with the strides the traced graph had
# (channels-last activations stay channels-last) instead of a layout of its own choosing, which
# the op would have to copy (`dense`). Explicit, not left to the config default
# (torch._functorch.config.custom_op_default_layout_constraint), which a user may change.
_TAGS = tuple(t for t in (torch.Tag.pt2_compliant_tag, getattr(torch.Tag, "needs_exact_strides", None))
              if t is not None)


class _Op:
    """A `ckgen::<name>` operator: the schema inferred from the CUDA implementation's type hints
    (`torch.library.infer_schema`, as custom_op does), that function registered as the CUDA
    kernel with `Library.impl`, and custom_op's registration methods (`register_kernel`,
    `register_fake`, `register_autograd`) on top of `torch.library`'s.

    Two overloads with the same schema and kernels: `ckgen::<name>` (`.default`), the one to
    call, with the autograd formula; and `ckgen::<name>.kernel`, with no autograd kernel of its
    own (PyTorch's C++ fallback runs at the Autograd key), which the formula's forward runs.
    Graphs traced by torch.compile/AOTAutograd therefore hold `.kernel`, and a compiled graph's
    call skips the Python autograd kernel that an eager call of `.default` needs: measured on
    a GPU host, a tiny max pool forward cost 22.5 us a call with the C++
    fallback and 26.8 us with the Python kernel; a no-op kernel 10.9 and 14.7 us.

    Why not `torch.library.custom_op`: its kernels run inside per-call Python wrappers. Measured on
    CPU with no-op kernels (torch 2.13): a call cost 17.8 us through custom_op and 11.1 us through
    this with an autograd formula registered, 15.5 vs 4.2 us without; compiled graphs pay that on
    every ckgen op they run. Calling an `_Op` calls `torch.ops.ckgen.<name>`."""

    def __init__(self, qualname: str, fn) -> None:
        ns, name = qualname.split("::")
        assert ns == NAMESPACE, qualname
        self._name, self._short, self._cuda = qualname, name, fn
        schema, tags = torch.library.infer_schema(fn, mutates_args=()), _TAGS
        self._overloads = (name, f"{name}.{KERNEL}")
        for overload in self._overloads:
            _LIB.define(overload + schema, tags=tags)
            _LIB.impl(overload, fn, "CUDA")
        self.packet = getattr(torch.ops.ckgen, name)
        self.default = self.packet.default
        self.kernel = getattr(self.packet, KERNEL)

    def __call__(self, *args, **kwargs):
        return self.packet(*args, **kwargs)

    def register_kernel(self, device_type: str):
        def register(fn):
            for overload in self._overloads:
                _LIB.impl(overload, fn, {"cpu": "CPU", "cuda": "CUDA"}[device_type])
            return fn
        return register

    def register_fake(self, fn):
        for overload in self._overloads:
            torch.library.register_fake(f"{NAMESPACE}::{overload}", fn, lib=_LIB)
        return fn

    def register_autograd(self, backward, setup_context=None) -> None:
        """torch.library.register_autograd's formula, behind a leaner Autograd-key kernel.

        Every eager call of the op enters the Autograd kernel. torch's generic one builds a
        metadata object and redispatches through Python on every call; this one hands calls
        that need a graph to torch's kernel (`make_autograd_impl`, the same formula and setup,
        its forward running `.kernel`), and runs the others directly: the CUDA implementation
        when the CUDA kernel is what the dispatcher would run next (no fake tensor, no mode, no
        other key in between), else `.kernel` below autograd (what tracing records). Measured on
        CPU (torch 2.13, a tiny max pool backward): the generic kernel costs 30 us a call over
        the computation, this one 20 us through the redispatch; the CUDA shortcut saves that
        redispatch too (about 6 us there). If torch's private helper is missing (another torch
        version), torch.library.register_autograd is used as is (graphs then hold `.default`)."""
        try:
            from torch._library import autograd as _tla

            generic = _tla.make_autograd_impl(self.kernel, _tla.Info(backward, setup_context))
        except (ImportError, AttributeError, TypeError):
            torch.library.register_autograd(self._name, backward, setup_context=setup_context, lib=_LIB)
            return
        op, cuda_impl = self.kernel, self._cuda
        below_autograd, cuda_key, C = torch._C._after_autograd_keyset, torch._C.DispatchKey.CUDA, torch._C

        def autograd_kernel(keyset, *args, **kwargs):
            if C.is_grad_enabled() and C._any_requires_grad(*args):
                return generic(keyset, *args, **kwargs)
            below = keyset & below_autograd
            if below.highestPriorityTypeId() == cuda_key:
                return cuda_impl(*args, **kwargs)
            with C._AutoDispatchBelowAutograd():
                return op.redispatch(below, *args, **kwargs)

        _LIB.impl(self._short, autograd_kernel, "Autograd", with_keyset=True)


# ---------------------------------------------------------------------------------------------
# Fallback notices: once per (op, reason), counted
# ---------------------------------------------------------------------------------------------
_lock = threading.Lock()
_fallbacks: dict[tuple[str, str], int] = {}


def note_fallback(op: str, reason: str) -> None:
    """Count a fallback to PyTorch and log it the first time for this (op, reason)."""
    with _lock:
        n = _fallbacks.get((op, reason), 0)
        _fallbacks[(op, reason)] = n + 1
    if n == 0:
        from .. import settings

        if not settings.quiet():
            log.warning("ckgen.torch: %s runs PyTorch's op instead of ckgen: %s", op, reason)


def fallbacks() -> dict[tuple[str, str], int]:
    """{(op, reason): count} of every call that ran PyTorch instead of ckgen, in this process
    (eager calls; under torch.compile the module-level choice is made once, at trace time)."""
    with _lock:
        return dict(_fallbacks)


def reset_fallbacks() -> None:
    """Forget the counts (the next fallback of each kind is logged again)."""
    with _lock:
        _fallbacks.clear()


# ---------------------------------------------------------------------------------------------
# Layout helpers (ckgen's rule: NCHW-contiguous wins when a tensor is both)
# ---------------------------------------------------------------------------------------------
def memory_format_of(x: Tensor, arg: str = "x") -> torch.memory_format:
    """torch.contiguous_format for an NCHW-contiguous 4-D tensor, torch.channels_last for a
    channels-last one; ValueError (like ckgen's) otherwise."""
    if x.dim() != 4:
        raise ValueError(f"{arg}: expected a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    if x.is_contiguous():
        return torch.contiguous_format
    if x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if not all(isinstance(s, int) for s in x.stride()):
        # Symbolic strides (torch.compile with dynamic shapes): is_contiguous cannot always prove
        # the layout of a tensor made with memory_format=channels_last; its stride 1 on C tells.
        return torch.channels_last if x.stride(1) == 1 and x.stride(3) != 1 else torch.contiguous_format
    raise ValueError(f"{arg}: strides {tuple(x.stride())} are neither NCHW-contiguous nor channels-last; "
                     f"call .contiguous() or .contiguous(memory_format=torch.channels_last)")


def _symbolic(x: Tensor) -> bool:
    return not all(isinstance(s, int) for s in x.stride())


def dense(x: Tensor, arg: str = "x") -> Tensor:
    """x itself when it is NCHW-contiguous or channels-last, else a copy in the nearer of the two
    (channels-last when C's stride is below W's, as in a crop or a strided slice of a
    channels-last buffer; NCHW otherwise: expands, transposed views, slices of NCHW buffers).

    Every op runs its tensors through this (or `like`) first, in the real kernels and the fake
    ones alike, so that any strided input works and the fake outputs' strides are the real
    ones': torch.compile's Inductor hands a custom op tensors of the strides it chooses (the
    ops ask for the traced strides with the needs_exact_strides tag, but a graph can still
    hold a view), and a user may call `torch.ops.ckgen.<op>` on a slice."""
    if x.dim() != 4:
        raise ValueError(f"{arg}: expected a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last) or _symbolic(x):
        return x  # symbolic strides: memory_format_of's reading stands (the real tensor has those strides)
    return x.contiguous(memory_format=_nearest_format(x))


def _nearest_format(x: Tensor) -> torch.memory_format:
    cl = x.shape[1] > 1 and (x.shape[3] == 1 or x.stride(1) < x.stride(3))
    return torch.channels_last if cl else torch.contiguous_format


def like(t: Tensor, x: Tensor) -> Tensor:
    """t (a gradient or indices shaped like x or like the pooled output) in x's layout; x dense."""
    fmt = memory_format_of(x)
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)


def _vec(t: Optional[Tensor]) -> Optional[Tensor]:
    """gamma, beta, mean or rstd as ckgen reads them: contiguous (an expanded or strided vector is copied)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _unread_x(x: Tensor) -> Tensor:
    """avg pooling's backward reads only x's shape, dtype, device and layout: a strided x is not
    copied, an empty tensor of dense(x)'s layout stands in for it."""
    if x.dim() == 4 and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last) or _symbolic(x)):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=layout_for(x))


def layout_for(x: Tensor) -> torch.memory_format:
    """The memory format `dense(x)` has (no copy made)."""
    if x.dim() != 4 or x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last) or _symbolic(x):
        return memory_format_of(x)
    return _nearest_format(x)


def _layout(x: Tensor) -> str:
    return "nchw" if memory_format_of(x) == torch.contiguous_format else "nhwc"


def _empty(shape, like: Tensor, fmt: torch.memory_format, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A new tensor of another shape than x, in x's layout (ckgen allocates those this way)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device, memory_format=fmt)


def _like_x(result: Tensor, x: Tensor) -> Tensor:
    """`result` in a tensor like x (torch.empty_like: x's dtype and strides, as ckgen allocates
    the outputs shaped like x)."""
    out = torch.empty_like(x)
    out.copy_(result)
    return out


def _act(activation: str) -> Optional[str]:
    if activation not in ("none", "swish"):
        raise ValueError(f"activation: expected 'none' or 'swish', got {activation!r}")
    return None if activation == "none" else activation


def _pair(v, arg: str) -> tuple[int, int]:
    v = list(v)
    if len(v) == 1:
        v = v * 2
    if len(v) != 2:
        raise ValueError(f"{arg}: expected an int or a pair of ints, got {v!r}")
    return v[0], v[1]


def pool_out_size(size, k: int, s: int, p: int, d: int, ceil_mode: bool):
    """PyTorch's pooling_output_shape (works on SymInts)."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out = out - 1
    return out


def _pool_out_shape(x: Tensor, kernel_size, stride, padding, dilation, ceil_mode) -> tuple:
    N, C, H, W = x.shape
    (kh, kw), (sh, sw) = _pair(kernel_size, "kernel_size"), _pair(stride, "stride")
    (ph, pw), (dh, dw) = _pair(padding, "padding"), _pair(dilation, "dilation")
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"padding: {(ph, pw)} must be at most half the kernel size {(kh, kw)} (PyTorch's rule)")
    return N, C, pool_out_size(H, kh, sh, ph, dh, ceil_mode), pool_out_size(W, kw, sw, pw, dw, ceil_mode)


# ---------------------------------------------------------------------------------------------
# Does ckgen serve this problem on this GPU? (cached; a "no" names the reason)
# ---------------------------------------------------------------------------------------------
_served: dict[tuple, Optional[str]] = {}


def _not_served(op_name: str, x: Tensor, **fields) -> Optional[str]:
    """None when ckgen runs `op_name` for this problem on x's GPU; else why not. Argument errors
    are left to the ckgen call itself (it raises them with the argument's name). Cached per call
    signature (x's dtype, shape, strides and device, and the fields as given), so a repeated call
    costs one tuple and one dict lookup."""
    sig = (op_name, x.dtype, x.shape, x.stride(), x.get_device(), *fields.items())
    hit = _served.get(sig, False)
    if hit is not False:
        return hit
    if len(_served) > 4096:
        _served.clear()
    why = _served[sig] = _not_served_problem(op_name, x, fields)
    return why


def _pool_not_served(op_name: str, x: Tensor, k: tuple, s: tuple, p: tuple, d: Optional[tuple], ceil_mode: bool,
                     extra: tuple) -> Optional[str]:
    """`_not_served` for a pooling op, cached by the arguments as the op received them (the
    sizes as tuples, `extra` the op's other fields as (name, value) pairs): a repeated call
    builds no field dicts or pairs (`_not_served` with `_pool_fields` cost 2.8 us a call on a
    GPU host). Kept in `_served` too (under keys of their own), so that clearing it forgets
    both."""
    key = (_pool_not_served, op_name, x.dtype, x.shape, x.stride(), x.get_device(), k, s, p, d, ceil_mode, extra)
    hit = _served.get(key, False)
    if hit is not False:
        return hit
    why = _not_served(op_name, x, **dict(extra), **_pool_fields(k, s, p, d, ceil_mode))
    _served[key] = why
    return why


def _not_served_problem(op_name: str, x: Tensor, fields: dict) -> Optional[str]:
    dt = _DTYPES.get(x.dtype)
    if dt is None or x.dim() != 4 or x.numel() == 0:
        return None  # ckgen raises the argument error
    try:
        layout = _layout(x)
    except ValueError:
        return None
    fields = dict(N=x.shape[0], C=x.shape[1], H=x.shape[2], W=x.shape[3], dtype=dt, layout=layout, **fields)
    from ..ops import get_op
    from ..types import KernelLimitError

    try:
        get_op(op_name).parse_problem(**fields)
    except KernelLimitError as e:
        return str(e)  # PyTorch's op computes it (64-bit indexing); ckgen's kernels cannot
    except (ValueError, TypeError):
        return None  # an argument error: the ckgen call raises it
    try:
        from ..runtime.target import device_info

        arch = device_info(x.device.index or 0).target.arch
    except Exception as e:  # CuPy missing or unusable
        return f"ckgen cannot use this GPU ({e.__class__.__name__}: {e})"
    import ckgen

    try:
        ckgen.explain(op_name, arch=arch, **fields)
    except ValueError as e:
        return str(e)
    return None


def _pool_fields(kernel_size, stride, padding, dilation=None, ceil_mode=False) -> dict:
    f = dict(kernel=_pair(kernel_size, "kernel_size"), stride=_pair(stride, "stride"),
             padding=_pair(padding, "padding"), ceil_mode=bool(ceil_mode))
    if dilation is not None:
        f["dilation"] = _pair(dilation, "dilation")
    return f


# ---------------------------------------------------------------------------------------------
# The PyTorch computations (CPU kernels, and the CUDA fallback); float32 math
# ---------------------------------------------------------------------------------------------
def _acc(x: Tensor) -> torch.dtype:
    """float32 math, float64 for float64 inputs (the CPU kernels also take float64, for gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ref_groupnorm_fwd(x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], groups: int, eps: float,
                      activation: str) -> tuple[Tensor, Tensor, Tensor]:
    x = dense(x)
    N, C, H, W = x.shape
    acc = _acc(x)
    xf = x.to(acc).reshape(N, groups, -1)
    mean = xf.mean(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
    y = ((xf - mean[..., None]) * rstd[..., None]).reshape(N, C, H, W)
    if gamma is not None:
        y = y * gamma.to(acc).reshape(1, C, 1, 1)
    if beta is not None:
        y = y + beta.to(acc).reshape(1, C, 1, 1)
    if _act(activation):
        y = F.silu(y)
    return _like_x(y, x), mean.float().contiguous(), rstd.float().contiguous()


def _ref_groupnorm_bwd_all(dy, x, mean, rstd, gamma, beta, groups, activation):
    x = dense(x)
    N, C, H, W = x.shape
    G = groups
    acc = _acc(x)
    xf, dyf = x.to(acc), dy.to(acc)
    m = mean.to(acc).reshape(N, G, 1).expand(N, G, C // G).reshape(N, C, 1, 1)
    r = rstd.to(acc).reshape(N, G, 1).expand(N, G, C // G).reshape(N, C, 1, 1)
    xhat = (xf - m) * r
    g = gamma.to(acc).reshape(1, C, 1, 1) if gamma is not None else None
    if _act(activation):
        z = xhat * g if g is not None else xhat
        if beta is not None:
            z = z + beta.to(acc).reshape(1, C, 1, 1)
        s = torch.sigmoid(z)
        dyf = dyf * (s * (1 + z * (1 - s)))
    dbeta = dyf.sum((0, 2, 3))
    dgamma = (dyf * xhat).sum((0, 2, 3))
    gd = (dyf * g if g is not None else dyf).reshape(N, G, -1)
    xh = xhat.reshape(N, G, -1)
    dx = rstd.to(acc).reshape(N, G, 1) * (gd - gd.mean(-1, keepdim=True) - xh * (gd * xh).mean(-1, keepdim=True))
    dx = _like_x(dx.reshape(N, C, H, W), x)
    return dx, dgamma.to(x.dtype), dbeta.to(x.dtype)


def ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta=None, activation="none"):
    return _ref_groupnorm_bwd_all(dy, x, mean, rstd, gamma, beta, groups, activation)


def ref_maxpool2d_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode):
    x = dense(x)
    fmt = memory_format_of(x)
    y, idx = F.max_pool2d(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode,
                          return_indices=True)
    return y.contiguous(memory_format=fmt), idx.contiguous(memory_format=fmt)


def ref_maxpool2d_bwd(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Overlapping windows' dy are summed in float32 and rounded once, as ckgen does."""
    x = dense(x)
    if indices is None:
        _, indices = F.max_pool2d(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode,
                                  return_indices=True)
    acc = _acc(x)
    dx = torch.ops.aten.max_pool2d_with_indices_backward(dy.to(acc), x.to(acc), list(kernel_size), list(stride),
                                                         list(padding), list(dilation), ceil_mode, indices)
    return _like_x(dx, x)


def ref_avgpool2d_fwd(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    x = dense(x)
    fmt = memory_format_of(x)
    y = F.avg_pool2d(x.to(_acc(x)), list(kernel_size), list(stride), list(padding), ceil_mode, count_include_pad,
                     divisor_override)
    return y.to(x.dtype).contiguous(memory_format=fmt)


def ref_avgpool2d_bwd(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    x = _unread_x(x)
    acc = _acc(x)
    dx = torch.ops.aten.avg_pool2d_backward(dy.to(acc), x.to(acc), list(kernel_size), list(stride), list(padding),
                                            ceil_mode, count_include_pad, divisor_override)
    return _like_x(dx, x)


# ---------------------------------------------------------------------------------------------
# GroupNorm ops
# ---------------------------------------------------------------------------------------------
def cuda_groupnorm_fwd(x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], groups: int, eps: float = 1e-5,
                       activation: str = "none") -> tuple[Tensor, Tensor, Tensor]:
    """ckgen::groupnorm_fwd on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    x, gamma, beta = dense(x), _vec(gamma), _vec(beta)
    why = _not_served("groupnorm_fwd", x, G=groups, activation=activation)
    if why:
        note_fallback("ckgen::groupnorm_fwd", why)
        return ref_groupnorm_fwd(x, gamma, beta, groups, eps, activation)
    import ckgen

    return ckgen.groupnorm_fwd(x, gamma, beta, groups, eps=eps, activation=_act(activation))


groupnorm_fwd = _Op("ckgen::groupnorm_fwd", cuda_groupnorm_fwd)


@groupnorm_fwd.register_kernel("cpu")
def _(x, gamma, beta, groups, eps=1e-5, activation="none"):
    return ref_groupnorm_fwd(x, gamma, beta, groups, eps, activation)


def _check_groups(x: Tensor, groups: int) -> None:
    if groups < 1 or x.shape[1] % groups:
        raise ValueError(f"groups: C={x.shape[1]} is not divisible by groups={groups}")


@groupnorm_fwd.register_fake
def _(x, gamma, beta, groups, eps=1e-5, activation="none"):
    x = dense(x)
    _check_groups(x, groups)
    _act(activation)
    N = x.shape[0]
    return (torch.empty_like(x), x.new_empty((N, groups), dtype=torch.float32),
            x.new_empty((N, groups), dtype=torch.float32))


# The fusion menu: act(GN(x + bias_nc[n, c]) * gamma + beta + residual) in one kernel
_FUSED_ACTS = {"none": lambda t: t, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _fused_act(activation: str):
    f = _FUSED_ACTS.get(activation)
    if f is None:
        raise ValueError(f"activation: expected one of {', '.join(map(repr, _FUSED_ACTS))}, got {activation!r}")
    return f


def _fused_args(x: Tensor, residual: Optional[Tensor], bias_nc: Optional[Tensor]):
    """x dense, the residual in x's layout, the bias (N, C) contiguous; shapes checked."""
    x = dense(x)
    if residual is not None:
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"residual: expected shape {tuple(x.shape)} (x's), got {tuple(residual.shape)}")
        residual = like(residual, x)
    if bias_nc is not None:
        if tuple(bias_nc.shape) != tuple(x.shape[:2]):
            raise ValueError(f"bias_nc: expected shape {tuple(x.shape[:2])} (x's N and C), got {tuple(bias_nc.shape)}")
        bias_nc = bias_nc.contiguous()
    return x, residual, bias_nc


def ref_groupnorm_fwd_fused(x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], groups: int, eps: float,
                            activation: str, residual: Optional[Tensor],
                            bias_nc: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    x, residual, bias_nc = _fused_args(x, residual, bias_nc)
    act = _fused_act(activation)
    acc = _acc(x)
    h = x.to(acc) + bias_nc.to(acc)[:, :, None, None] if bias_nc is not None else x.to(acc)
    N, C, H, W = x.shape
    hg = h.reshape(N, groups, -1)
    mean = hg.mean(-1)
    rstd = torch.rsqrt(hg.var(-1, unbiased=False) + eps)
    y = ((hg - mean[..., None]) * rstd[..., None]).reshape(N, C, H, W)
    if gamma is not None:
        y = y * gamma.to(acc).reshape(1, C, 1, 1)
    if beta is not None:
        y = y + beta.to(acc).reshape(1, C, 1, 1)
    if residual is not None:
        y = y + residual.to(acc)
    return _like_x(act(y), x), mean.float().contiguous(), rstd.float().contiguous()


def cuda_groupnorm_fwd_fused(x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], groups: int,
                             eps: float = 1e-5, activation: str = "none", residual: Optional[Tensor] = None,
                             bias_nc: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """ckgen::groupnorm_fwd_fused on CUDA tensors: one ckgen kernel (slice_in=lean), or where no
    kernel holds the tile the plain kernel with PyTorch's add and activation (ckgen.groupnorm_fwd
    does that); PyTorch's computation where ckgen cannot use the GPU."""
    x, residual, bias_nc = _fused_args(x, residual, bias_nc)
    gamma, beta = _vec(gamma), _vec(beta)
    _fused_act(activation)
    why = _not_served("groupnorm_fwd", x, G=groups, activation="none")
    if why:
        note_fallback("ckgen::groupnorm_fwd_fused", why)
        return ref_groupnorm_fwd_fused(x, gamma, beta, groups, eps, activation, residual, bias_nc)
    import ckgen

    return ckgen.groupnorm_fwd(x, gamma, beta, groups, eps=eps, activation=None if activation == "none" else activation,
                               residual=residual, bias_nc=bias_nc)


groupnorm_fwd_fused = _Op("ckgen::groupnorm_fwd_fused", cuda_groupnorm_fwd_fused)


@groupnorm_fwd_fused.register_kernel("cpu")
def _(x, gamma, beta, groups, eps=1e-5, activation="none", residual=None, bias_nc=None):
    return ref_groupnorm_fwd_fused(x, gamma, beta, groups, eps, activation, residual, bias_nc)


@groupnorm_fwd_fused.register_fake
def _(x, gamma, beta, groups, eps=1e-5, activation="none", residual=None, bias_nc=None):
    x, residual, bias_nc = _fused_args(x, residual, bias_nc)
    _check_groups(x, groups)
    _fused_act(activation)
    N = x.shape[0]
    return (torch.empty_like(x), x.new_empty((N, groups), dtype=torch.float32),
            x.new_empty((N, groups), dtype=torch.float32))


def _gn_bwd_args(dy, x, mean, rstd, gamma, beta):
    """The backward ops' tensors as ckgen reads them: x dense, dy in x's layout, vectors contiguous."""
    x = dense(x)
    return like(dy, x), x, _vec(mean), _vec(rstd), _vec(gamma), _vec(beta)


def _bwd_not_served(op_name: str, x: Tensor, groups: int, activation: str) -> Optional[str]:
    return _not_served(op_name, x, G=groups, activation=activation)


def cuda_groupnorm_bwd(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Optional[Tensor], groups: int,
                       beta: Optional[Tensor] = None, activation: str = "none") -> tuple[Tensor, Tensor, Tensor]:
    """ckgen::groupnorm_bwd on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    dy, x, mean, rstd, gamma, beta = _gn_bwd_args(dy, x, mean, rstd, gamma, beta)
    why = _bwd_not_served("groupnorm_bwd", x, groups, activation)
    if why:
        note_fallback("ckgen::groupnorm_bwd", why)
        return ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation)
    import ckgen

    return ckgen.groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation=_act(activation))


groupnorm_bwd = _Op("ckgen::groupnorm_bwd", cuda_groupnorm_bwd)


@groupnorm_bwd.register_kernel("cpu")
def _(dy, x, mean, rstd, gamma, groups, beta=None, activation="none"):
    return ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation)


@groupnorm_bwd.register_fake
def _(dy, x, mean, rstd, gamma, groups, beta=None, activation="none"):
    x = dense(x)
    _check_groups(x, groups)
    C = x.shape[1]
    return torch.empty_like(x), x.new_empty((C,)), x.new_empty((C,))


def cuda_groupnorm_bwd_data(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Optional[Tensor], groups: int,
                            beta: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    """ckgen::groupnorm_bwd_data on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    dy, x, mean, rstd, gamma, beta = _gn_bwd_args(dy, x, mean, rstd, gamma, beta)
    why = _bwd_not_served("groupnorm_bwd_data", x, groups, activation)
    if why:
        note_fallback("ckgen::groupnorm_bwd_data", why)
        return ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation)[0]
    import ckgen

    return ckgen.groupnorm_bwd_data(dy, x, mean, rstd, gamma, groups, beta, activation=_act(activation))


groupnorm_bwd_data = _Op("ckgen::groupnorm_bwd_data", cuda_groupnorm_bwd_data)


@groupnorm_bwd_data.register_kernel("cpu")
def _(dy, x, mean, rstd, gamma, groups, beta=None, activation="none"):
    return ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation)[0]


@groupnorm_bwd_data.register_fake
def _(dy, x, mean, rstd, gamma, groups, beta=None, activation="none"):
    x = dense(x)
    _check_groups(x, groups)
    return torch.empty_like(x)


def cuda_groupnorm_bwd_gamma_beta(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, groups: int,
                                  gamma: Optional[Tensor] = None, beta: Optional[Tensor] = None,
                                  activation: str = "none") -> tuple[Tensor, Tensor]:
    """ckgen::groupnorm_bwd_gamma_beta on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    dy, x, mean, rstd, gamma, beta = _gn_bwd_args(dy, x, mean, rstd, gamma, beta)
    why = _bwd_not_served("groupnorm_bwd_gamma_beta", x, groups, activation)
    if why:
        note_fallback("ckgen::groupnorm_bwd_gamma_beta", why)
        return ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation)[1:]
    import ckgen

    return ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, groups, gamma, beta, activation=_act(activation))


groupnorm_bwd_gamma_beta = _Op("ckgen::groupnorm_bwd_gamma_beta", cuda_groupnorm_bwd_gamma_beta)


@groupnorm_bwd_gamma_beta.register_kernel("cpu")
def _(dy, x, mean, rstd, groups, gamma=None, beta=None, activation="none"):
    return ref_groupnorm_bwd(dy, x, mean, rstd, gamma, groups, beta, activation)[1:]


@groupnorm_bwd_gamma_beta.register_fake
def _(dy, x, mean, rstd, groups, gamma=None, beta=None, activation="none"):
    x = dense(x)
    _check_groups(x, groups)
    C = x.shape[1]
    return x.new_empty((C,)), x.new_empty((C,))


# ---------------------------------------------------------------------------------------------
# Pooling ops
# ---------------------------------------------------------------------------------------------
def cuda_maxpool2d_fwd(x: Tensor, kernel_size: List[int], stride: List[int], padding: List[int], dilation: List[int],
                       ceil_mode: bool) -> Tensor:
    """ckgen::maxpool2d_fwd on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    x = dense(x)
    k, s, p, d = tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation)
    why = _pool_not_served("maxpool2d_fwd", x, k, s, p, d, ceil_mode, (("return_indices", False),))
    if why:
        note_fallback("ckgen::maxpool2d_fwd", why)
        return ref_maxpool2d_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)[0]
    import ckgen

    return ckgen.maxpool2d_fwd(x, k, s, p, d, ceil_mode)


maxpool2d_fwd = _Op("ckgen::maxpool2d_fwd", cuda_maxpool2d_fwd)


@maxpool2d_fwd.register_kernel("cpu")
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    return ref_maxpool2d_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)[0]


@maxpool2d_fwd.register_fake
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    fmt = layout_for(x)
    return _empty(_pool_out_shape(x, kernel_size, stride, padding, dilation, ceil_mode), x, fmt)


def cuda_maxpool2d_fwd_with_indices(x: Tensor, kernel_size: List[int], stride: List[int], padding: List[int],
                                    dilation: List[int], ceil_mode: bool) -> tuple[Tensor, Tensor]:
    """ckgen::maxpool2d_fwd_with_indices on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    x = dense(x)
    k, s, p, d = tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation)
    why = _pool_not_served("maxpool2d_fwd", x, k, s, p, d, ceil_mode, (("return_indices", True),))
    if why:
        note_fallback("ckgen::maxpool2d_fwd_with_indices", why)
        return ref_maxpool2d_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)
    import ckgen

    return ckgen.maxpool2d_fwd(x, k, s, p, d, ceil_mode, return_indices=True)


maxpool2d_fwd_with_indices = _Op("ckgen::maxpool2d_fwd_with_indices", cuda_maxpool2d_fwd_with_indices)


@maxpool2d_fwd_with_indices.register_kernel("cpu")
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    return ref_maxpool2d_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)


@maxpool2d_fwd_with_indices.register_fake
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    fmt = layout_for(x)
    shape = _pool_out_shape(x, kernel_size, stride, padding, dilation, ceil_mode)
    return _empty(shape, x, fmt), _empty(shape, x, fmt, torch.int64)


_STORED, _RECOMPUTE = (("indices", "stored"),), (("indices", "recompute"),)


def cuda_maxpool2d_bwd(dy: Tensor, x: Tensor, kernel_size: List[int], stride: List[int], padding: List[int],
                       dilation: List[int], ceil_mode: bool, indices: Optional[Tensor] = None) -> Tensor:
    """ckgen::maxpool2d_bwd on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    x = dense(x)
    dy, indices = like(dy, x), None if indices is None else like(indices, x)
    k, s, p, d = tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation)
    why = _pool_not_served("maxpool2d_bwd", x, k, s, p, d, ceil_mode,
                           _RECOMPUTE if indices is None else _STORED)
    if why:
        note_fallback("ckgen::maxpool2d_bwd", why)
        return ref_maxpool2d_bwd(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices)
    import ckgen

    return ckgen.maxpool2d_bwd(dy, x, k, s, p, d, ceil_mode, indices=indices)


maxpool2d_bwd = _Op("ckgen::maxpool2d_bwd", cuda_maxpool2d_bwd)


@maxpool2d_bwd.register_kernel("cpu")
def _(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices=None):
    return ref_maxpool2d_bwd(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices)


@maxpool2d_bwd.register_fake
def _(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices=None):
    x = dense(x)
    _pool_out_shape(x, kernel_size, stride, padding, dilation, ceil_mode)
    return torch.empty_like(x)


def cuda_avgpool2d_fwd(x: Tensor, kernel_size: List[int], stride: List[int], padding: List[int], ceil_mode: bool,
                       count_include_pad: bool, divisor_override: Optional[int] = None) -> Tensor:
    """ckgen::avgpool2d_fwd on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    x = dense(x)
    k, s, p = tuple(kernel_size), tuple(stride), tuple(padding)
    why = _pool_not_served("avgpool2d_fwd", x, k, s, p, None, ceil_mode,
                           (("count_include_pad", bool(count_include_pad)), ("divisor_override", divisor_override)))
    if why:
        note_fallback("ckgen::avgpool2d_fwd", why)
        return ref_avgpool2d_fwd(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    import ckgen

    return ckgen.avgpool2d_fwd(x, k, s, p, ceil_mode, count_include_pad, divisor_override)


avgpool2d_fwd = _Op("ckgen::avgpool2d_fwd", cuda_avgpool2d_fwd)


@avgpool2d_fwd.register_kernel("cpu")
def _(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
    return ref_avgpool2d_fwd(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@avgpool2d_fwd.register_fake
def _(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
    fmt = layout_for(x)
    return _empty(_pool_out_shape(x, kernel_size, stride, padding, (1, 1), ceil_mode), x, fmt)


def cuda_avgpool2d_bwd(dy: Tensor, x: Tensor, kernel_size: List[int], stride: List[int], padding: List[int],
                       ceil_mode: bool, count_include_pad: bool, divisor_override: Optional[int] = None) -> Tensor:
    """ckgen::avgpool2d_bwd on CUDA tensors (what the custom op runs; also the eager fast path's kernel)."""
    x = _unread_x(x)
    dy = like(dy, x)
    k, s, p = tuple(kernel_size), tuple(stride), tuple(padding)
    why = _pool_not_served("avgpool2d_bwd", x, k, s, p, None, ceil_mode,
                           (("count_include_pad", bool(count_include_pad)), ("divisor_override", divisor_override)))
    if why:
        note_fallback("ckgen::avgpool2d_bwd", why)
        return ref_avgpool2d_bwd(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    import ckgen

    return ckgen.avgpool2d_bwd(dy, x, k, s, p, ceil_mode, count_include_pad, divisor_override)


avgpool2d_bwd = _Op("ckgen::avgpool2d_bwd", cuda_avgpool2d_bwd)


@avgpool2d_bwd.register_kernel("cpu")
def _(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
    return ref_avgpool2d_bwd(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@avgpool2d_bwd.register_fake
def _(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
    x = _unread_x(x)
    _pool_out_shape(x, kernel_size, stride, padding, (1, 1), ceil_mode)
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------
def _needs(ctx, i: int) -> bool:
    n = ctx.needs_input_grad
    return i < len(n) and bool(n[i])


def grad_like(g: Tensor, x_or_fmt, dtype: torch.dtype) -> Tensor:
    """An incoming gradient in the dtype and memory layout the backward kernel needs."""
    fmt = x_or_fmt if isinstance(x_or_fmt, torch.memory_format) else layout_for(x_or_fmt)
    return g.to(dtype).contiguous(memory_format=fmt)


def _gn_setup(ctx, inputs, output):
    x, gamma, beta = inputs[0], inputs[1], inputs[2]
    groups = inputs[3]
    activation = inputs[5] if len(inputs) > 5 else "none"
    _, mean, rstd = output
    ctx.groups, ctx.activation = groups, activation
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, gamma, beta if activation == "swish" else None, mean, rstd)


def gn_grads(dy, x, gamma, beta, mean, rstd, groups, activation, need_x, need_g, need_b, impl=None):
    """(dx, dgamma, dbeta) of GroupNorm, None where not needed, through the backward op that computes
    just what is needed (groupnorm_bwd, _bwd_data or _bwd_gamma_beta). `impl(name)`: the function
    to run for backward op `name` (default: the custom op; the eager fast path passes ckgen's
    function or the CUDA implementation: `eager.Call.kernel`); they all take the same arguments."""
    dx = dgamma = dbeta = None
    dy = grad_like(dy, x, x.dtype)
    pick = impl or ALL_OPS.__getitem__
    if need_x and (need_g or need_b):
        dx, dgamma, dbeta = pick("groupnorm_bwd")(dy, x, mean, rstd, gamma, groups, beta, activation)
    elif need_x:
        dx = pick("groupnorm_bwd_data")(dy, x, mean, rstd, gamma, groups, beta, activation)
    elif need_g or need_b:
        dgamma, dbeta = pick("groupnorm_bwd_gamma_beta")(dy, x, mean, rstd, groups, gamma, beta, activation)
    return dx, dgamma if need_g else None, dbeta if need_b else None


def _gn_backward(ctx, dy, _dmean, _drstd):
    x, gamma, beta, mean, rstd = ctx.saved_tensors
    grads = gn_grads(dy, x, gamma, beta, mean, rstd, ctx.groups, ctx.activation,
                     _needs(ctx, 0), _needs(ctx, 1), _needs(ctx, 2))
    return (*grads, None, None, None)


groupnorm_fwd.register_autograd(_gn_backward, setup_context=_gn_setup)


def _gn_fused_setup(ctx, inputs, output):
    x, gamma, beta, groups = inputs[:4]
    activation = inputs[5] if len(inputs) > 5 else "none"
    residual = inputs[6] if len(inputs) > 6 else None
    bias_nc = inputs[7] if len(inputs) > 7 else None
    _, mean, rstd = output
    ctx.groups, ctx.activation = groups, activation
    ctx.has_residual = residual is not None
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, gamma, beta, residual if activation != "none" else None, bias_nc, mean, rstd)


def _gn_fused_backward(ctx, dy, _dmean, _drstd):
    """The fused forward's gradients, composed (the backward kernels fuse none of relu, gelu,
    the residual or the bias yet): the activation's derivative at z = GN(h) * gamma + beta + r
    (z recomputed from the saved inputs, h = x + bias), then GroupNorm's backward kernel at h;
    d residual = dz, d bias[n, c] = the sum of dh over H, W."""
    x, gamma, beta, residual, bias_nc, mean, rstd = ctx.saved_tensors
    x, residual, bias_nc = _fused_args(x, residual, bias_nc)
    h = x + bias_nc[:, :, None, None].to(x.dtype) if bias_nc is not None else x
    h = h.contiguous(memory_format=memory_format_of(x))
    dz = dy
    if ctx.activation != "none":
        N, C, H, W = x.shape
        acc = _acc(x)
        hg = h.to(acc).reshape(N, ctx.groups, -1)
        z = ((hg - mean.to(acc)[..., None]) * rstd.to(acc)[..., None]).reshape(N, C, H, W)
        if gamma is not None:
            z = z * gamma.to(acc).reshape(1, C, 1, 1)
        if beta is not None:
            z = z + beta.to(acc).reshape(1, C, 1, 1)
        if residual is not None:
            z = z + residual.to(acc)
        with torch.enable_grad():
            z = z.detach().requires_grad_()
            (dz,) = torch.autograd.grad(_fused_act(ctx.activation)(z), z, dy.to(acc))
    need_h = _needs(ctx, 0) or _needs(ctx, 7)
    dh, dgamma, dbeta = gn_grads(dz, h, gamma, beta, mean, rstd, ctx.groups, "none", need_h,
                                 _needs(ctx, 1), _needs(ctx, 2))
    dres = grad_like(dz, x, x.dtype) if ctx.has_residual and _needs(ctx, 6) else None
    dbias = dh.float().sum((2, 3)).to(bias_nc.dtype) if bias_nc is not None and _needs(ctx, 7) else None
    return (dh if _needs(ctx, 0) else None, dgamma, dbeta, None, None, None, dres, dbias)


groupnorm_fwd_fused.register_autograd(_gn_fused_backward, setup_context=_gn_fused_setup)


def _max_setup(ctx, inputs, output):
    x, kernel_size, stride, padding, dilation, ceil_mode = inputs
    ctx.params = (list(kernel_size), list(stride), list(padding), list(dilation), bool(ceil_mode))
    if isinstance(output, tuple):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, output[1])
    else:
        ctx.save_for_backward(x, None)


def _max_backward(ctx, dy, *_didx):
    x, indices = ctx.saved_tensors
    if not _needs(ctx, 0):
        return None, None, None, None, None, None
    dx = maxpool2d_bwd(grad_like(dy, x, x.dtype), x, *ctx.params, indices)
    return dx, None, None, None, None, None


maxpool2d_fwd.register_autograd(_max_backward, setup_context=_max_setup)
maxpool2d_fwd_with_indices.register_autograd(_max_backward, setup_context=_max_setup)


def avg_x_meta(x: Tensor) -> tuple:
    """What avg pooling's backward keeps of x: shape, dtype, device and layout (no tensor)."""
    return tuple(x.shape), x.dtype, x.device, layout_for(x)


def avg_dx(dy: Tensor, x_meta: tuple, params: tuple, bwd=None) -> Tensor:
    """avg pooling's dx from dy alone, through `bwd` (default: the custom op; the eager fast path
    passes ckgen's function or the CUDA implementation, which take the same arguments)."""
    shape, dtype, device, fmt = x_meta
    x_like = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)  # never read
    return (bwd or avgpool2d_bwd)(grad_like(dy, fmt, dtype), x_like, *params)


def _avg_setup(ctx, inputs, output):
    x, kernel_size, stride, padding, ceil_mode, count_include_pad = inputs[:6]
    divisor_override = inputs[6] if len(inputs) > 6 else None
    ctx.params = (list(kernel_size), list(stride), list(padding), bool(ceil_mode), bool(count_include_pad),
                  divisor_override)
    ctx.x_meta = avg_x_meta(x)  # nothing saved


def _avg_backward(ctx, dy):
    if not _needs(ctx, 0):
        return None, None, None, None, None, None, None
    return avg_dx(dy, ctx.x_meta, ctx.params), None, None, None, None, None, None


avgpool2d_fwd.register_autograd(_avg_backward, setup_context=_avg_setup)


def _no_double_backward(name: str):
    def backward(ctx, *grads):
        raise DoubleBackwardError(
            f"ckgen::{name} has no backward: ckgen does not support double backward (a gradient of "
            f"a gradient, e.g. backward(create_graph=True) then backward again, or gradient penalties). "
            f"Run that part of the model with PyTorch's own modules (leave them out of ckgen.torch.convert).")

    def setup(ctx, inputs, output):
        pass

    return backward, setup


for _op in (groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta, maxpool2d_bwd, avgpool2d_bwd):
    _b, _s = _no_double_backward(_op._name.split("::")[-1])
    _op.register_autograd(_b, setup_context=_s)


ALL_OPS = {op._name.split("::")[-1]: op for op in (
    groupnorm_fwd, groupnorm_fwd_fused, groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta, maxpool2d_fwd,
    maxpool2d_fwd_with_indices, maxpool2d_bwd, avgpool2d_fwd, avgpool2d_bwd)}
