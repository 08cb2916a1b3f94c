"""Reading tuning records (ckgen/records.py `read`), CPU tier: a line no JSON parser can take
whole (nested deeper than the interpreter's recursion limit) is one more malformed line."""
from __future__ import annotations

import json
import warnings

from ckgen import records
from ckgen.ops import get_op
from ckgen.ops.spec import Target


def _line(N: int) -> str:
    op = get_op("groupnorm_fwd")
    p = op.parse_problem(N=N, C=64, H=8, W=8, G=8, dtype="fp16", layout="nhwc")
    rec = records.make_record(op, p, Target.named("sm_90"), "test device", op.space.default, ok=True, time_us=3.5)
    return json.dumps(rec)


def test_a_deeply_nested_line_is_skipped_not_fatal(tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    deep_obj = '{"op": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_000 + "}"
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join([_line(1), deep, _line(2), deep_obj, _line(3)]) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = records.read(path)
    assert [r["problem"].split(",")[0] for r in got] == ["N=1", "N=2", "N=3"]
    mine = [w for w in caught if issubclass(w.category, records.RecordsWarning)]
    assert len(mine) == 1 and "skipped 2 malformed line(s)" in str(mine[0].message)
    assert "line 2" in str(mine[0].message) and "nested" in str(mine[0].message)
