"""GPU tier: the CLI's device commands as a user runs them. `ckgen bench` times every one of the
eight ops (quick suites, no torch.compile) and reports each row measured; `ckgen explain` without
--arch explains for the visible device."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from ckgen import cli  # noqa: E402
from ckgen.offline.opbench import OPS  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def shipped_db(monkeypatch):
    monkeypatch.delenv("CKGEN_SHIPPED_DB", raising=False)  # the packaged DB, as a user has it


def test_bench_measures_every_op(shipped_db, tmp_path, capsys):
    assert len(OPS) == 8
    code = cli.main(["bench", "--ops", ",".join(OPS), "--quick", "--no-compile", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    (report,) = tmp_path.glob("bench-*.json")
    rows = json.loads(report.read_text())["rows"]
    assert {r["op"] for r in rows} == set(OPS)
    for r in rows:
        assert "error" not in r, r
        for side in ("ckgen", "eager"):  # both views measured; they differ by design (GPU time flushes
            # L2 before each run; host-inclusive time is back-to-back calls, which L2 can serve)
            assert all(0 < r[f"{side}_{view}_us"] < 1e6 for view in ("gpu", "host")), r
    assert list(tmp_path.glob("bench-*.md"))


def test_explain_uses_the_visible_device(shipped_db, capsys):
    code = cli.main(["explain", "groupnorm_fwd", "--shape", "2,320,64,64", "--groups", "32", "--dtype", "bf16",
                     "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads(out)
    major, minor = torch.cuda.get_device_capability()
    assert doc["op"] == "groupnorm_fwd" and doc["arch"] == f"sm_{major}{minor}"
    (choice,) = doc["choices"]
    assert choice["instance"].startswith("ckgen_groupnorm_fwd_bf16_nchw") and choice["source"] in (
        "tuned", "model", "nearest", "default")
