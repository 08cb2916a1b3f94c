"""Argument errors of the public ops and of `ckgen.explain`, CPU tier: each names the argument
and says what is wrong before anything is launched (no GPU needed: the errors come first)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import ckgen
from ckgen.runtime.api import groupnorm as api_gn
from ckgen.runtime.dispatch import Dispatcher
from ckgen.ops import get_op
from ckgen.ops.spec import Target

torch = pytest.importorskip("torch")
F = torch.nn.functional
SM90 = Target.named("sm_90")
GN = get_op("groupnorm_fwd")


# ------------------------------------------------------------------ tensors


def test_a_meta_tensor_is_called_a_meta_tensor():
    x = torch.empty(2, 8, 4, 4, device="meta")
    with pytest.raises(TypeError, match="^x: a meta tensor"):
        ckgen.groupnorm_fwd(x, None, None, 2)
    with pytest.raises(TypeError, match="^x: a meta tensor"):
        ckgen.maxpool2d_fwd(x, 3)
    with pytest.raises(TypeError, match="^x: a CPU torch tensor; move it to the GPU with x.cuda()"):
        ckgen.groupnorm_fwd(torch.empty(2, 8, 4, 4), None, None, 2)


# ------------------------------------------------------------------ problems and explain


def test_activation_none_in_a_problem_means_none():
    """None is what the public functions take for "no activation" (their default); a problem
    given None said "None is not one of None, 'swish', ..."."""
    kw = dict(N=2, C=32, H=4, W=4, G=8, dtype="bf16", layout="nchw")
    assert GN.parse_problem(**kw, activation=None) == GN.parse_problem(**kw, activation="none")
    assert ckgen.explain("groupnorm_fwd", **kw, activation=None, arch="sm_90").problem.endswith("act=none")
    with pytest.raises(ValueError, match="^activation: 'tanh' is not one of None, 'swish', 'relu'"):
        GN.parse_problem(**kw, activation="tanh")


@pytest.mark.parametrize("op, kw, word", [
    ("groupnorm_fwd", dict(N=2, C=320, G=32, dtype="bf16", layout="nhwc"), "H: missing"),
    ("groupnorm_bwd", dict(N=2, C=320, H=8, W=8, G=32, layout="nhwc"), "dtype: missing"),
    ("groupnorm_fwd", dict(N=2, C=320, H=8, W=8, G=32, dtype="bf16", layout="nhwc", groups=32),
     "groups: not a field of a GroupNorm problem"),
    ("maxpool2d_fwd", dict(N=2, C=32, H=8, W=8, dtype="bf16", layout="nhwc"), "kernel_size: missing"),
    ("avgpool2d_bwd", dict(N=2, C=32, H=8, W=8, kernel_size=3, dtype="bf16"), "layout: missing"),
    ("maxpool2d_bwd", dict(N=2, C=32, H=8, W=8, kernel=3, dtype="bf16", layout="nchw", return_indices=True),
     "return_indices: not a field of a maxpool2d_bwd problem"),
])
def test_explain_names_a_missing_or_unknown_problem_field(op, kw, word):
    with pytest.raises(TypeError, match=f"^{word}") as e:
        ckgen.explain(op, **kw, arch="sm_90")
    assert "N, C, H, W" in str(e.value)  # and lists the fields


def test_pool_plane_of_2_31_elements_is_an_argument_error():
    """No config can index such a plane (32-bit ints): the problem check says so, naming the
    size, instead of the dispatcher's "no config of the tuning space can run"."""
    with pytest.raises(ValueError, match="^H: an \\(n, c\\) plane of H x W = 65536 x 32768 = 2147483648"):
        ckgen.explain("maxpool2d_fwd", N=1, C=1, H=2**16, W=2**15, kernel_size=1, dtype="fp32", layout="nchw",
                      arch="sm_90")
    with pytest.raises(ValueError, match="^W: an \\(n, c\\) plane"):
        get_op("avgpool2d_bwd").parse_problem(N=1, C=1, H=3, W=2**30, kernel=3, dtype="fp32", layout="nhwc")
    # an input plane under the limit whose output plane (padding widens it) is not
    with pytest.raises(ValueError, match="^H: the output plane of OH x OW = 2147483638 x 2"):
        get_op("maxpool2d_fwd").parse_problem(N=1, C=1, H=2**31 - 10, W=1, kernel=(1, 2), stride=1, padding=(0, 1),
                                              dtype="fp32", layout="nchw")
    ok = get_op("maxpool2d_fwd").parse_problem(N=1, C=1, H=2**31 - 10, W=1, kernel=(1, 1), dtype="fp32",
                                               layout="nchw")
    assert ok.OH * ok.OW < 2**31


def test_no_config_says_the_most_common_reasons():
    op = get_op("maxpool2d_fwd")
    p = op.parse_problem(N=1, C=3, H=8, W=8, kernel=3, dtype="fp32", layout="nchw")
    with pytest.raises(ValueError, match="no config of the tuning space can run") as e:
        Dispatcher().choose(op, p, SM90, max_vec_bytes=2)  # no fp32 vector fits in 2 bytes
    msg = str(e.value)
    assert "the most common reasons" in msg
    assert "exceeds the pointers' 2-byte alignment" in msg and "is not a whole number of fp32 elements" in msg
    assert len(msg) < 600


# ------------------------------------------------------------------ GroupNorm of one value


@pytest.fixture
def cpu_as_device(monkeypatch):
    """The public GroupNorm forward's checks on CPU torch tensors: as_device_tensor takes them
    as device tensors, and the plan is a stub (nothing is compiled or launched)."""
    from ckgen.runtime import tensors

    real = tensors.as_device_tensor
    dtypes = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

    def as_device(obj, arg):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return tensors.DeviceTensor(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                                        dtypes[obj.dtype], 0)
        return real(obj, arg)

    planned = []
    monkeypatch.setattr(tensors, "as_device_tensor", as_device)
    monkeypatch.setattr(api_gn, "plan_for", lambda op, p, *a: planned.append(p) or SimpleNamespace(choice=p))
    return planned


SHAPES = [(1, 2, 1, 1, 2), (1, 1, 1, 1, 1), (1, 4, 1, 1, 4), (2, 2, 1, 1, 2), (1, 2, 1, 1, 1), (1, 1, 2, 1, 1),
          (1, 4, 1, 1, 2), (3, 6, 1, 1, 6)]


@pytest.mark.parametrize("N, C, H, W, G", SHAPES)
def test_a_group_of_one_value_raises_where_pytorch_does(cpu_as_device, N, C, H, W, G):
    """F.group_norm refuses N*(C/G)*H*W == 1 ("Expected more than 1 value per channel when
    training"); ckgen's forward computed y = beta there. It raises the same, naming x, before
    a plan is built; every other shape is planned."""
    x = torch.randn(N, C, H, W)
    try:
        F.group_norm(x, G)
        torch_raises = False
    except ValueError as e:
        assert "Expected more than 1 value per channel" in str(e)
        torch_raises = True
    if torch_raises:
        with pytest.raises(ValueError, match="^x: shape .* N\\*\\(C/groups\\)\\*H\\*W = 1"):
            ckgen.groupnorm_fwd(x, None, None, G)
        assert not cpu_as_device
    else:
        assert ckgen.explain("groupnorm_fwd", x, None, None, G).key() == GN.parse_problem(
            N=N, C=C, H=H, W=W, G=G, dtype="fp32", layout="nchw").key()
        assert len(cpu_as_device) == 1
