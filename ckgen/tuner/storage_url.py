"""Storage URLs in messages, their passwords masked.

A study storage URL (`dialect+driver://user:password@host:port/db?password=...`) reaches
messages through ckgen's own texts and through the exception texts of SQLAlchemy, optuna and the
database drivers, which may embed it whole, quoted by repr(), percent-decoded, or in parts, and
for URLs that SQLAlchemy cannot parse as well as for those it can. So the masking is textual,
and one function, `mask`, does all of it for every message that can hold a URL:

  - the password of every `user:password@` (with a scheme or without one),
  - the value of every `password=` (also `passwd=`, `pwd=`, `sslpassword=`; URL query or
    libpq key=value string; its "=" percent-encoded too, as in `?conninfo=password%3D...`) and
    every `'password': '...'` of a printed dict,
  - and, when the URL is given, every occurrence of the passwords it holds, as written,
    percent-decoded and repr()-escaped (a password of fewer than MIN_SECRET characters only
    where it stands in one of the forms above: masking every "ab" of a message would make it
    unreadable).

Nothing here imports SQLAlchemy at module level (the CLI imports this for every command)."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote, unquote, unquote_plus

MASK = "***"
MIN_SECRET = 4
MAX_MESSAGE = 600  # characters of a storage message: the drivers' texts run to several lines

# `user:password@`: an optional scheme, a user without separators, then the password, as far as
# the last "@" before white space (a password may hold "@", "/" or ":" unencoded; masking a host
# along with it is better than showing part of it). Not `scheme://user@`: no password there.
_USERINFO = re.compile(r"(?P<pre>(?:[A-Za-z][A-Za-z0-9+.\-]*://)?[^\s:/@'\"]*):(?!//)(?P<pw>\S*)@")
# `password=value` in a URL query or a libpq string (also `sslpassword=`, any key ending so), its
# "=" also percent-encoded (`?conninfo=password%3D...`: psycopg decodes the parameter and reads a
# password from it): a quoted value whole, else up to & # or space (an encoded value runs past
# an encoded space: masking more than the password is better than showing part of it)
_PARAM = re.compile(r"(?i)(?P<pre>(?:password|passwd|pwd)\s*(?:=|%3d)\s*)"
                    r"(?P<pw>'(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?|[^&#\s'\"]*)")
# `'password': 'value'` of a printed mapping (connection arguments)
_DICT = re.compile(r"(?i)(?P<pre>['\"]\w*(?:password|passwd|pwd)['\"]\s*:\s*)"
                   r"(?P<pw>'(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?|[^,}\s]*)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _secrets(url: str) -> set[str]:
    """Every string of `url` that may be (a part of) a password, in the forms a message may show."""
    found: set[str] = set()
    rest = _SCHEME.sub("", url, count=1)
    if "@" in rest:
        first = rest[:rest.find("@")]
        last = rest[:rest.rfind("@")]
        for userinfo in {first, last}:
            if ":" in userinfo:
                pw = userinfo.split(":", 1)[1]
                found.add(pw)
                found.update(pw.split("@"))  # SQLAlchemy reads `a:p@ss@h` as password p, host ss@h
    for text in (url, unquote_plus(url)):  # as typed, and as the driver decodes a parameter
        for m in _PARAM.finditer(text):
            found.add(m.group("pw").strip("'\""))
            # the rest of the URL too: a password typed with an unencoded & # or space runs past
            # the value the query syntax gives it
            found.add(text[m.end("pre"):])
    try:
        from sqlalchemy.engine import make_url

        u = make_url(url)
        found.add(u.password or "")
        values = (u.query or {}).get("password", ())
        found.update([values] if isinstance(values, str) else values)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: the textual finds stand
        pass
    forms: set[str] = set()
    for s in found:
        for f in (s, unquote(s), unquote_plus(s), quote(s, safe=""), quote(unquote(s), safe="")):
            forms.update((f, repr(f)[1:-1], f.replace("\\", "\\\\")))
    return {f for f in forms if len(f) >= MIN_SECRET}


def mask(text: str, url: str | None = None) -> str:
    """`text` with every storage password masked (see the module's docstring); `url`, the
    storage URL the text may be about (its passwords are masked wherever they appear)."""
    text = str(text)
    if url:
        # longest first: a password that holds a shorter one is masked whole
        for s in sorted(_secrets(str(url)), key=len, reverse=True):
            text = text.replace(s, MASK)
    text = _USERINFO.sub(lambda m: f"{m.group('pre')}:{MASK}@", text)
    text = _PARAM.sub(lambda m: m.group("pre") + MASK, text)
    return _DICT.sub(lambda m: m.group("pre") + f"'{MASK}'", text)


def shown(url: str | None) -> str:
    """A storage URL to print: its passwords masked."""
    return mask(str(url), url)


def message(text: str, url: str | None = None) -> str:
    """A storage error for one line of output: masked, its lines joined (SQLAlchemy's
    "Background on this error" link dropped), bounded."""
    lines = [ln.strip() for ln in mask(str(text), url).splitlines()]
    one = " ".join(ln for ln in lines if ln and not ln.startswith("(Background on this error"))
    return one if len(one) <= MAX_MESSAGE else one[:MAX_MESSAGE - 3] + "..."


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite storage URL (None: not SQLite, or in memory)."""
    if not isinstance(url, str) or not url.startswith("sqlite:"):
        return None
    try:
        from sqlalchemy.engine import make_url

        db = make_url(url).database
    except Exception:  # noqa: BLE001 - storage_problem reports a URL that does not parse
        return None
    return Path(db) if db and db != ":memory:" and not db.startswith("file:") else None


# optuna's notices that the heartbeat options and the stale-trial sweep ckgen uses are experimental
_HEARTBEAT_NOTICES = (r"(Argument ``(heartbeat_interval|grace_period|failed_trial_callback|"
                      r"heartbeat_stale_trial_callback)``|([\w.]*\.)?(fail_stale_trials|Retry\w*TrialCallback)"
                      r"(\.\w+)?) is (an )?experimental")


def quiet_heartbeat_notices() -> None:
    """Ignore optuna's ExperimentalWarnings about the heartbeat options and the stale-trial sweep
    that ckgen's storages use, for the whole process and for those notices only. A filter set
    inside `warnings.catch_warnings()` does not hold with threads: the filters are process-wide,
    and another thread leaving its own `catch_warnings` block restores the list it saved, so a
    tuner thread's notice escaped. Called when ckgen's tune module is imported (before any
    thread saves the filters) and again for each storage ckgen opens (the list may have been
    reset since); a filter already present is moved to the front, not added twice."""
    import warnings

    warnings.filterwarnings("ignore", message=_HEARTBEAT_NOTICES)
