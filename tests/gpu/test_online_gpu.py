"""GPU tier: online tuning on the device. Inside `ckgen.tuning()` the first call of an untuned
problem tunes it (the real in-process tuner), writes the user DB, returns correct results and
explains as tuned; a later call does not tune again; under CUDA-graph capture nothing is tuned
and the captured call still replays correctly."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import torch.nn.functional as F  # noqa: E402

import ckgen  # noqa: E402
from ckgen.runtime import db as dbmod  # noqa: E402
from ckgen.tuner import online
from ckgen import settings  # noqa: E402
from ckgen.tuner.online import OnlineTuningWarning  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_dispatcher():
    ckgen.reload_db()
    yield
    ckgen.reload_db()


@pytest.fixture
def tuner_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    real = online.tuner

    def counted(op, problem, **kw):
        calls.append(kw)
        return real(op, problem, **kw)

    monkeypatch.setattr(online, "tuner", counted)
    return calls


def test_first_call_in_a_tuning_block_tunes_writes_the_db_and_is_correct(tuner_calls) -> None:
    G = 6
    x = (torch.randn(3, 48, 17, 19, device="cuda") + 0.5).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    gamma = (1 + 0.2 * torch.randn(48, device="cuda")).to(torch.bfloat16)
    beta = (0.2 * torch.randn(48, device="cuda")).to(torch.bfloat16)
    with ckgen.tuning(trials=3, max_seconds=300):
        y, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, G)
    torch.cuda.synchronize()
    ref = F.group_norm(x.float(), G, gamma.float(), beta.float(), 1e-5)
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    assert y.stride() == x.stride()
    assert [c["trials"] for c in tuner_calls] == [3]
    choice = ckgen.explain("groupnorm_fwd", x, gamma, beta, G)
    assert choice.source == "tuned" and "tuned online" in choice.reason, choice
    saved = dbmod.InstanceDB.load(settings.user_db_path()).lookup("groupnorm_fwd", choice.entry.arch, choice.problem)
    assert saved is not None and saved.provenance_dict()["tuned_by"] == "online"
    with ckgen.tuning(trials=3):
        ckgen.groupnorm_fwd(x, gamma, beta, G)  # its plan is built: nothing more
    ckgen.reload_db()
    with ckgen.tuning(trials=3):
        ckgen.groupnorm_fwd(x, gamma, beta, G)  # rebuilt from the DB entry: tuned, not tuned again
    assert len(tuner_calls) == 1


def test_nothing_is_tuned_under_cuda_graph_capture(tuner_calls, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    x = torch.randn(2, 24, 9, 7, device="cuda").to(torch.float16)
    g = torch.cuda.CUDAGraph()
    with pytest.warns(OnlineTuningWarning, match="capturing"):
        with torch.cuda.graph(g, capture_error_mode="relaxed"):  # the plan is built under capture
            y = ckgen.avgpool2d_fwd(x, 3, 2, 1)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, F.avg_pool2d(x, 3, 2, 1), atol=2e-3, rtol=2e-3)
    assert not tuner_calls
    assert ckgen.explain("avgpool2d_fwd", x, 3, 2, 1).source != "tuned"
