"""How the CLI prints its tables, in one of three formats (`--format`):

- `table`: rich tables for a person at a terminal. Identifiers (ops, problem keys, instance
  names, devices) are never cut: on a narrow terminal the long ones (problem keys, instance
  names) go on lines of their own under their row, whole.
- `tsv`: one header line of column keys, then one line per row, tab-separated; several tables
  are separated by one empty line. The default when stdout is not a terminal (`ckgen list | cat`).
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
        lines = ["\t".join(c.key for c in s.cols)]
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


def to_rich(sheet: Sheet, width: int) -> Any:
    """`sheet` for a console `width` columns wide; no cell is ever cut. A table when it fits.
    Narrower, its long identifiers (`wide` columns: problem keys, instance names) move to lines
    of their own under each row, whole (a terminal wraps a line longer than itself). Failing
    that, the table's cells fold onto more lines."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    texts = [[c.text(v) for c, v in zip(sheet.cols, row)] for row in sheet.rows]
    natural = _natural(sheet, texts)
    chrome = 3 * len(sheet.cols) + 1  # borders and padding
    short = [i for i, c in enumerate(sheet.cols) if not c.wide]
    if sum(natural) + chrome > width and len(short) < len(sheet.cols):
        return _records(sheet, texts, natural, short, Text)
    t = Table(title=sheet.title or None, box=box.SQUARE, title_justify="left")
    fits = sum(natural) + chrome <= width
    for i, c in enumerate(sheet.cols):
        t.add_column(c.title or c.key, justify="right" if c.number else "left", no_wrap=c.number,
                     overflow="fold", min_width=natural[i] if fits or c.number else None)
    for row in texts:
        t.add_row(*row)
    return t


def _records(sheet: Sheet, texts: list[list[str]], natural: list[int], short: list[int], Text: Any) -> Any:
    from rich.console import Group

    def line(cells: list[str]) -> str:
        out = []
        for i, cell in zip(short, cells):
            out.append(cell.rjust(natural[i]) if sheet.cols[i].number else cell.ljust(natural[i]))
        return "  ".join(out).rstrip()

    wide = [i for i in range(len(sheet.cols)) if i not in short]
    # A row is known by its first short identifier; without one, by its first long one, which
    # then leads the record on a line of its own.
    lead = wide[0] if not any(sheet.cols[i].ident for i in short) else None
    rest = [i for i in wide if i != lead]
    label = max((len(sheet.cols[i].title or sheet.cols[i].key) for i in rest), default=0)
    pad = "  " if lead is not None else ""
    parts: list[Any] = []
    if sheet.title:
        parts.append(Text(sheet.title, style="italic"))
    head = [sheet.cols[i].title or sheet.cols[i].key for i in short]
    if lead is not None:
        parts.append(Text(sheet.cols[lead].title or sheet.cols[lead].key, style="bold"))
    parts.append(Text(pad + line(head), style="bold"))
    for row in texts:
        if lead is not None:
            parts.append(Text(row[lead]))
        parts.append(Text(pad + line([row[i] for i in short])))
        for i in (i for i in rest if row[i]):
            parts.append(Text(f"{pad}  {(sheet.cols[i].title or sheet.cols[i].key).ljust(label)}  {row[i]}"))
    return Group(*parts)


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
