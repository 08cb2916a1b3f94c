"""How the CLI prints its tables, in one of three formats (`--format`):

- `table`: rich tables for a person at a terminal. Identifiers (ops, archs, problem keys,
  instance names, paths) and numbers are never cut nor wrapped, at any width: text columns wrap
  between words; on a narrower terminal the long identifiers (problem keys, instance names,
  paths), then the row's other columns (text first), go on lines of their own under their row,
  whole (`to_rich`).
- `tsv`: one header line of column keys, then one line per row, tab-separated. Several tables
  are separated by one empty line, and each starts with a caption line, `# name: title` (a
  comment to TSV readers such as pandas' `comment="#"`), so a reader knows which is which. The
  default when stdout is not a terminal (`ckgen list | cat`).
- `json`: one JSON document, `{table name: [row objects], ...}`, with numbers as numbers.

Without `--format`, a terminal gets `table` and anything else `tsv`. Messages about progress
go to stderr whenever stdout carries tsv or json, so a pipe reads data alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

FORMATS = ("table", "tsv", "json")


@dataclass(frozen=True)
class Col:
    key: str  # the JSON key and the TSV header
    title: str = ""  # the table header (default: the key)
    fmt: Callable[[Any], str] | None = None  # value -> text for table and TSV (default: str)
    number: bool = False  # right-justified, never wrapped
    ident: bool = False  # an identifier (op, arch, problem key, instance name): never cut
    wide: bool = False  # a long identifier: on a line of its own under its row when the table is too wide

    def text(self, value: Any) -> str:
        if value is None:
            return ""
        return self.fmt(value) if self.fmt else str(value)


@dataclass
class Sheet:
    name: str  # the JSON key of its rows
    title: str  # the table's title (table format only)
    cols: Sequence[Col]
    rows: list[Sequence[Any]] = field(default_factory=list)

    def add(self, *values: Any) -> None:
        if len(values) != len(self.cols):
            raise ValueError(f"{self.name}: {len(values)} values for {len(self.cols)} columns")
        self.rows.append(values)


def resolve(fmt: str | None, console: Any) -> str:
    """The format to print: the one asked for, else `table` on a terminal and `tsv` elsewhere."""
    if fmt:
        return fmt
    return "table" if console.is_terminal else "tsv"


def _cell(text: str) -> str:
    return text.replace("\t", " ").replace("\r", " ").replace("\n", " ")


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


def to_tsv(sheets: Sequence[Sheet]) -> str:
    blocks = []
    for s in sheets:
        caption = [f"# {s.name}: {_cell(s.title)}" if s.title else f"# {s.name}"] if len(sheets) > 1 else []
        lines = caption + ["\t".join(c.key for c in s.cols)]
        lines += ["\t".join(_cell(c.text(v)) for c, v in zip(s.cols, row)) for row in s.rows]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def to_json(sheets: Sequence[Sheet], extra: dict[str, Any] | None = None) -> str:
    doc: dict[str, Any] = dict(_jsonable(extra or {}))
    for s in sheets:
        doc[s.name] = [{c.key: _jsonable(v) for c, v in zip(s.cols, row)} for row in s.rows]
    return json.dumps(doc, indent=2) + "\n"


def _natural(sheet: Sheet, texts: list[list[str]]) -> list[int]:
    return [max([len(c.title or c.key)] + [len(t[i]) for t in texts]) for i, c in enumerate(sheet.cols)]


def _title(c: Col) -> str:
    return c.title or c.key


def _least(sheet: Sheet, texts: list[list[str]]) -> list[int]:
    """The narrowest each column may be: an identifier's or a number's widest cell (never cut or
    wrapped), a text column's longest word (text wraps between words); headers wrap between
    words either way."""
    out = []
    for i, c in enumerate(sheet.cols):
        words = _title(c).split() or [""]
        if c.ident or c.number:
            cells = [len(t[i]) for t in texts]
        else:
            cells = [len(w) for t in texts for w in t[i].split()]
        out.append(max([1] + [len(w) for w in words] + cells))
    return out


def _spread(sheet: Sheet, cols: Sequence[int], least: list[int], natural: list[int], room: int) -> dict[int, int]:
    """Widths for `cols` from their least widths, `room` more columns shared out toward their
    natural widths: first to the text columns (fewer wrapped lines), then to wrapped headers."""
    widths = {i: least[i] for i in cols}
    text = [i for i in cols if not sheet.cols[i].ident and not sheet.cols[i].number]
    for group in (text, list(cols)):
        want = {i: natural[i] - widths[i] for i in group if widths[i] < natural[i]}
        total = sum(want.values())
        if room <= 0 or not total:
            continue
        if total <= room:
            give = want
        else:  # in proportion to what each lacks, the remainder one by one to the widest lacks
            give = {i: room * w // total for i, w in want.items()}
            for i in sorted(want, key=lambda i: -want[i])[:room - sum(give.values())]:
                give[i] += 1
        for i, g in give.items():
            widths[i] += g
            room -= g
    return widths


def to_rich(sheet: Sheet, width: int) -> Any:
    """`sheet` for a console `width` columns wide. Identifiers and numbers are never cut nor
    wrapped: a table when they fit whole on their rows with the text columns wrapped between
    words. Narrower, the long identifiers (`wide` columns: problem keys, instance names, paths)
    go on lines of their own under each row, whole (a terminal wraps a line longer than itself),
    and so, while the row is still too wide, do its other columns, text ones first."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    texts = [[c.text(v) for c, v in zip(sheet.cols, row)] for row in sheet.rows]
    natural = _natural(sheet, texts)
    least = _least(sheet, texts)
    n = len(sheet.cols)
    chrome = 3 * n + 1  # borders and padding
    if sum(least) + chrome > width:
        return _records(sheet, texts, natural, least, width)
    widths = _spread(sheet, range(n), least, natural, width - chrome - sum(least))
    t = Table(box=box.SQUARE)
    for i, c in enumerate(sheet.cols):
        # an identifier's or number's width holds its widest cell: only headers and text wrap
        t.add_column(_title(c), justify="right" if c.number else "left", overflow="fold", width=widths[i])
    for row in texts:
        t.add_row(*row)
    return Group(*_title_lines(sheet, width), t)


def _wrap(text: str, width: int) -> list[str]:
    """Text wrapped between words to `width` (a longer word folds)."""
    import textwrap

    return textwrap.wrap(text, max(1, width), break_long_words=True, break_on_hyphens=False) or [""]


def _records(sheet: Sheet, texts: list[list[str]], natural: list[int], least: list[int], width: int) -> Any:
    """A row per record: the columns that fit on one line (text ones wrapped), then each of the
    others as `label  value` under it. A row is known by its first identifier on that line;
    when none is left there, the first identifier leads the record on a line of its own."""
    from rich.console import Group
    from rich.text import Text

    cols = sheet.cols
    n = len(cols)

    def line_width(idx: list[int]) -> int:
        pad = 0 if any(cols[i].ident for i in idx) else 2
        return pad + sum(least[i] for i in idx) + 2 * max(0, len(idx) - 1)

    inline = [i for i in range(n) if not cols[i].wide]
    while inline and line_width(inline) > width:  # move out text, then identifiers, then numbers
        inline.remove(max(inline, key=lambda i: (not cols[i].ident and not cols[i].number,
                                                 not cols[i].number, least[i], -i)))
    lead = None if any(cols[i].ident for i in inline) else next(
        (i for i in range(n) if cols[i].ident), None)
    pad = "" if lead is None else "  "
    rest = [i for i in range(n) if i not in inline and i != lead]
    widths = _spread(sheet, inline, least, natural, width - line_width(inline)) if inline else {}
    label = max((len(_title(cols[i])) for i in rest), default=0)

    def row_lines(cells: list[str]) -> list[str]:
        columns = []
        for i, cell in zip(inline, cells):
            w = widths[i]
            parts = [cell] if (cols[i].ident or cols[i].number) and len(cell) <= w else _wrap(cell, w)
            columns.append([p.rjust(w) if cols[i].number else p.ljust(w) for p in parts])
        depth = max((len(c) for c in columns), default=0)
        return [(pad + "  ".join(c[k] if k < len(c) else " " * widths[i] for i, c in zip(inline, columns))).rstrip()
                for k in range(depth)]

    def field(i: int, value: str) -> list[str]:
        head = f"{pad}  {_title(cols[i]).ljust(label)}  "
        if not cols[i].ident:  # text wraps under itself; a number is short
            if width - len(head) >= 20:
                body = _wrap(value, width - len(head))
                return [head + body[0]] + [" " * len(head) + b for b in body[1:]]
            return [f"{pad}  {_title(cols[i])}"] + [f"{pad}    {b}" for b in _wrap(value, width - len(pad) - 4)]
        if len(head) + len(value) <= width:
            return [head + value]
        indent = f"{pad}    " if len(pad) + 4 + len(value) <= width else ""
        return [f"{pad}  {_title(cols[i])}", indent + value]  # an identifier whole, alone on its line

    parts: list[Any] = _title_lines(sheet, width)
    if lead is not None:
        parts.append(Text(_title(cols[lead]), style="bold"))
    if inline:
        parts += [Text(ln, style="bold") for ln in row_lines([_title(cols[i]) for i in inline])]
    for row in texts:
        if lead is not None:
            parts.append(Text(row[lead]))
        if inline:
            parts += [Text(ln) for ln in row_lines([row[i] for i in inline])]
        for i in (i for i in rest if row[i]):
            parts += [Text(ln) for ln in field(i, row[i])]
    return Group(*parts)


def _title_lines(sheet: Sheet, width: int) -> list[Any]:
    """The sheet's title, wrapped between words (a word longer than `width` stays whole)."""
    import textwrap

    from rich.text import Text

    if not sheet.title:
        return []
    return [Text(ln, style="italic") for ln in textwrap.wrap(sheet.title, max(1, width), break_long_words=False,
                                                              break_on_hyphens=False)]


def emit(console: Any, fmt: str, sheets: Sequence[Sheet], extra: dict[str, Any] | None = None) -> None:
    """Print `sheets` (and, for json, the `extra` keys first) on `console` in `fmt`."""
    if fmt == "json":
        console.file.write(to_json(sheets, extra))
    elif fmt == "tsv":
        console.file.write(to_tsv(sheets))
    else:
        for s in sheets:
            console.print(to_rich(s, console.width))
    console.file.flush()
