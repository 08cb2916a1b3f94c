"""The DB shipped in the package: loads cleanly, and every entry still matches the templates
(a template edit must come with re-tuned or removed entries, never silently stale ones)."""
from __future__ import annotations

from ckgen.runtime import db
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target


def test_packaged_db_is_current():
    path = db.packaged_db_path()
    if not path.is_file():  # nothing shipped yet is fine; a broken file is not
        return
    shipped = db.InstanceDB.load(path)
    assert not shipped.skipped, shipped.skipped
    assert shipped.entries, "an empty shipped DB should not be committed"
    for e in shipped.entries:
        op = get_op(e.op)
        problem = op.problem_from_key(e.problem)
        target = Target.named(e.arch)
        config = Config.of(e.config_dict())
        ok = op.validate(problem, config, target)
        assert ok, f"{e.problem}: {ok.reason}"
        src = render_instance(op, problem, config, target)
        assert src.name == e.instance
        assert src.sha256 == e.source_sha256, (
            f"{e.instance}: the template changed since it was tuned; re-tune or remove the entry")


def test_env_var_replaces_the_packaged_db(tmp_path, monkeypatch):
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(tmp_path / "other.yaml"))
    assert db.shipped_db_path() == tmp_path / "other.yaml"
    monkeypatch.delenv("CKGEN_SHIPPED_DB")
    assert db.shipped_db_path() == db.packaged_db_path()
