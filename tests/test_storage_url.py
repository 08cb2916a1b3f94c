"""Storage URLs in messages: `ckgen tune`, `retune` and `db pull` name their --storage
in errors and progress lines; no password of it may show, whatever the URL and whichever layer
(ckgen, SQLAlchemy, optuna, the driver) wrote the message."""
from __future__ import annotations

import threading
import warnings
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

SECRET = "S3CRETPW"

# What a user may type: the URLs that printed their password before (unknown kind, a driver that
# is not installed, a bad port, password= parameters, no scheme, ...) and others like them.
BAD_URLS = [
    f"postgres://bob:{SECRET}@127.0.0.1:1/db",
    f"postgresql+psycopg2://bob:{SECRET}@127.0.0.1:1/db",
    f"postgresql+psycopg://bob:{SECRET}@127.0.0.1:notaport/db",
    f"postgresql+psycopg://bob@127.0.0.1:1/db?password={SECRET}",
    f"bob:{SECRET}@127.0.0.1/db",
    f"mysql://bob:{SECRET}@127.0.0.1/db",
    f"postgresql+psycopg://bob:{SECRET}@127.0.0.1:1/db",
    f"postgresql+psycopg://bob:S3C@RETPW@127.0.0.1:1/db",
    f"postgresql+psycopg://bob:{SECRET}@127.0.0.1:99999/db",
    f"postgresql+psycopg://bob:{SECRET}@[::1:1/db",
    f"postgresql+psycopg:///db?host=127.0.0.1&port=1&user=bob&password={SECRET}",
    f"//bob:{SECRET}@127.0.0.1/db",
    f"postgresql+psycopg://bob:S3%2FCRETPW@127.0.0.1:1/db",
    f"sqlite:///{{tmp}}/no/such/dir/studies.db?password={SECRET}",
    f"postgresql+psycopg://bob:{SECRET}@127.0.0.1:1/db?sslmode=bogus&password={SECRET}",
]


def _commands(url: str) -> list[list[str]]:
    return [["db", "pull", "--storage", url], ["tune", "groupnorm_fwd", "--storage", url],
            ["retune", "--storage", url]]


def _leaks(text: str, password: str) -> list[str]:
    """The forms of `password` that show in `text` (as typed, percent-decoded)."""
    return [p for p in {password, unquote(password)} if len(p) >= 4 and p in text]


@pytest.mark.parametrize("url", BAD_URLS)
def test_storage_errors_show_no_password(inproc, tmp_path, url) -> None:
    url = url.replace("{tmp}", str(tmp_path))
    for argv in _commands(url):
        code, out, err = inproc(*argv)
        shown = out + err
        secret = "S3C@RETPW" if "S3C@RETPW" in url else "S3%2FCRETPW" if "%2F" in url else SECRET
        assert not _leaks(shown, secret), (argv, shown)
        if argv[0] == "db":  # pull connects: every one of these fails, on one line
            assert code == 2 and len(err.strip().splitlines()) == 1 and "--storage" in err, (argv, shown)
            assert "Traceback" not in shown


# Any printable ASCII around a marker, so that the password cannot show by coincidence (a
# password "host" would): separators (@ : / ? # & = % ' space) in every position of it, and in
# the user name and the rest of the URL around it.
_ANY = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=10)
_PASSWORD = st.builds(lambda a, b: f"{a}Zq7{b}", _ANY.filter(bool), _ANY)
_SHAPES = (
    "{scheme}{user}:{pw}@127.0.0.1:1/{rest}",  # userinfo; port 1: refused at once
    "{scheme}{user}@127.0.0.1:1/db?{rest}password={pw}",  # a query parameter
    "{scheme}{user}:{pw}@{rest}",  # userinfo, then anything
    "{scheme}127.0.0.1:1/db?host=127.0.0.1&password={pw}&{rest}",
    "{scheme}{user}@127.0.0.1:x/db?password='{pw}'",  # a bad port, a quoted value
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scheme=st.sampled_from(["postgresql+psycopg://", "postgresql://", "postgres://", "postgresql+psycopg2://",
                               "mysql://", "sqlite://", "bogus://", "", "//", "postgresql+psycopg:"]),
       shape=st.sampled_from(_SHAPES), user=_ANY, password=_PASSWORD, rest=_ANY)
def test_fuzzed_storage_urls_show_no_password(inproc, scheme, shape, user, password, rest) -> None:
    url = shape.format(scheme=scheme, user=user, pw=password, rest=rest)
    for argv in _commands(url):
        code, out, err = inproc(*argv)
        assert not _leaks(out + err, password), (url, argv, out + err)
        assert "Traceback" not in err


@pytest.mark.parametrize("text, url, want", [
    (f"'postgresql://bob:{SECRET}@h/db' is not a database URL", None, "'postgresql://bob:***@h/db' is not"),
    (f"name its driver: postgresql+psycopg://user@host:5432/db", None, "postgresql+psycopg://user@host:5432/db"),
    (f"dsn host=h password={SECRET} port=1", None, "password=*** port=1"),
    (f"dsn host=h password='a b {SECRET}' port=1", None, "password=*** port=1"),
    (f"kwargs {{'password': '{SECRET}', 'user': 'bob'}}", None, "{'password': '***', 'user': 'bob'}"),
    (f"failed to resolve host 'RETPW@h'", f"postgresql://bob:S3C@RETPW@h/db", "failed to resolve host '***@h'"),
    (f"it said {SECRET!r} and {SECRET}", f"postgresql://bob:{SECRET}@h/db", "it said '***' and ***"),
])
def test_mask_forms(text, url, want) -> None:
    from ckgen.tuner.storage_url import mask

    got = mask(text, url)
    assert want in got and SECRET not in got


def test_storage_message_is_one_line() -> None:
    from ckgen.tuner.storage_url import message

    got = message("OperationalError: connection refused\n\tIs the server running?\n"
                  "(Background on this error at: https://sqlalche.me/e/21/e3q8)", None)
    assert got == "OperationalError: connection refused Is the server running?"


def test_heartbeat_notices_stay_filtered_when_another_thread_restores_the_warning_filters(tmp_path, monkeypatch):
    """The filters are process-wide: a thread leaving its `warnings.catch_warnings()` block
    restores the list it saved, undoing what `open_storage`'s own block set meanwhile, and the
    notice that the heartbeat option is experimental escaped (the PostgreSQL worker tests showed
    it). Here the other thread leaves its block just as a second storage is made. (The first
    storage ckgen opens, or the import of ckgen.tuner.tune outside a test, puts the filter in the
    list every later block saves; pytest restores the list after each test.)"""
    import optuna

    from ckgen.tuner import tune

    tune.open_storage(f"sqlite:///{tmp_path / 'first.sqlite3'}")
    real_init = optuna.storages.RDBStorage.__init__
    inside, go, left = threading.Event(), threading.Event(), threading.Event()

    def other_thread() -> None:
        with warnings.catch_warnings():  # saves the filters before open_storage sets its own
            inside.set()
            go.wait(10)
        left.set()

    def init(self, *args, **kw) -> None:
        go.set()
        left.wait(10)  # the other thread has restored the filters it saved
        real_init(self, *args, **kw)

    monkeypatch.setattr(optuna.storages.RDBStorage, "__init__", init)
    with warnings.catch_warnings(record=True) as got:
        t = threading.Thread(target=other_thread)
        t.start()
        assert inside.wait(10)
        tune.open_storage(f"sqlite:///{tmp_path / 's.sqlite3'}")
        t.join(10)
    assert left.is_set()
    experimental = [str(w.message) for w in got if issubclass(w.category, optuna.exceptions.ExperimentalWarning)]
    assert experimental == []


@pytest.mark.parametrize("url", [
    f"postgresql+psycopg://bob@127.0.0.1:1/db?conninfo=password%3D{SECRET}",
    f"postgresql+psycopg://bob@127.0.0.1:1/db?conninfo=password%3D{SECRET}%20sslmode%3Drequire",
    f"postgresql+psycopg://bob@127.0.0.1:1/db?options=x&conninfo=host%3Dh+password%3d{SECRET}",
])
def test_a_percent_encoded_password_parameter_is_masked(inproc, url) -> None:
    """`?conninfo=password%3D...` (psycopg reads it as the password) was printed in clear."""
    from ckgen.tuner.storage_url import mask, shown

    assert SECRET not in shown(url) and SECRET not in mask(url) and SECRET not in mask(f"at {url}: refused", url)
    code, out, err = inproc("db", "pull", "--storage", url)
    assert code == 2 and SECRET not in out + err, err


@pytest.mark.parametrize("url", ["sqlite:///", "sqlite://", "sqlite:///:memory:"])
def test_a_sqlite_storage_in_memory_is_refused(inproc, tmp_path, monkeypatch, url) -> None:
    """`db pull --storage sqlite:///:memory:` said "no entries", exit 0, and left `:memory:.lock`
    in the working folder: a storage in memory holds no studies and is gone with the command."""
    monkeypatch.chdir(tmp_path)
    for argv in (["db", "pull", "--storage", url], ["tune", "groupnorm_fwd", "--storage", url]):
        code, out, err = inproc(*argv)
        assert code == 2 and "--storage" in err and "in memory" in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_db_pull_of_a_sqlite_file_that_is_no_study_storage_leaves_it_untouched(inproc, tmp_path) -> None:
    """`db pull` on an existing SQLite file of something else added optuna's tables to it."""
    import sqlite3

    path = tmp_path / "other.sqlite3"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE notes (t TEXT)")
    before = path.read_bytes()
    code, out, err = inproc("db", "pull", "--storage", f"sqlite:///{path}", "--db", str(tmp_path / "db.yaml"))
    assert code == 2 and "not an optuna study storage" in err and len(err.strip().splitlines()) == 1, err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.sqlite3"]  # no lock files left either
