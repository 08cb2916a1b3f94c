"""What convert() reads in a module class's source: a forward's fingerprint, how a method uses a
submodule attribute, and whether a forward calls a norm then an activation back to back.

Model libraries do not say in data what their blocks compute; their forwards do. convert()'s
adapters therefore recognize a class by its qualified name *and* by its source: a block whose
forward is not one the adapter was written against is left as it is (and the report says so),
rather than converted on a guess.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

# Fields that differ between Python versions or carry no meaning for what the code computes.
_SKIP_FIELDS = {"ctx", "type_comment", "type_params", "kind", "lineno", "col_offset", "end_lineno",
                "end_col_offset"}


def _canon(node) -> str:
    """A canonical text of an AST: node types and fields, without positions, load/store contexts
    and the fields newer Pythons add, empty ones omitted (ast.dump's output changes between
    Python versions; this does not)."""
    if isinstance(node, ast.AST):
        parts = []
        for k, v in ast.iter_fields(node):
            if k in _SKIP_FIELDS or v is None or v == []:
                continue
            parts.append(f"{k}={_canon(v)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canon(v) for v in node) + "]"
    return repr(node)


def _strip_docstring(body: list) -> list:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


@lru_cache(maxsize=256)
def _function_ast(fn) -> Optional[ast.FunctionDef]:
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def fingerprint(fn) -> Optional[str]:
    """A short hash of what `fn` computes: its arguments and body (docstring, comments, layout
    and decorators left out), the same on every Python version; None when its source cannot be
    read."""
    node = _function_ast(getattr(fn, "__func__", fn))
    if node is None:
        return None
    return _hash(node)


def _hash(node) -> str:
    return hashlib.sha1((_canon(node.args) + _canon(_strip_docstring(node.body))).encode()).hexdigest()[:16]


def source_fingerprint(src: str) -> str:
    """`fingerprint` of the function defined by the source text `src` (one def)."""
    return _hash(ast.parse(textwrap.dedent(src)).body[0])


def class_fingerprint(cls: type, method: str = "forward") -> Optional[str]:
    """`fingerprint` of the method `cls` runs under that name (its own or inherited)."""
    fn = getattr(cls, method, None)
    return None if fn is None else fingerprint(fn)


# ---------------------------------------------------------------------------------------------
# how a class's methods use `self.<attr>`
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Use:
    method: str  # the method's name
    kind: str  # "call" (self.attr(...)), "test" (if self.attr:, self.attr is None), or "other"
    what: str  # the use as source text, for reports
    guards: tuple = ()  # the tests of the ifs around it, as source: "self.flag" in a body, "not (self.flag)" in an else


_SKIP_METHODS = ("__init__", "extra_repr", "__repr__", "__setstate__", "__getstate__")


def _methods(cls: type):
    """(name, function) of the methods defined by cls and its bases, torch.nn's own classes and
    object excluded (their code is known), the first definition of each name only."""
    seen = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch."):
            continue
        for name, fn in vars(klass).items():
            if name in seen or name in _SKIP_METHODS or "init" in name.lower():
                continue
            fn = getattr(fn, "__func__", fn)
            if inspect.isfunction(fn):
                seen.add(name)
                yield name, fn


def _parents(tree: ast.AST) -> dict:
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _is_self_attr(node, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self" and isinstance(node.ctx, ast.Load))


def _use_kind(node, parents: dict) -> str:
    p = parents.get(node)
    if isinstance(p, ast.Call) and p.func is node:
        return "call"
    if isinstance(p, (ast.If, ast.While, ast.IfExp, ast.Assert)) and p.test is node:
        return "test"
    if isinstance(p, ast.UnaryOp) and isinstance(p.op, ast.Not):
        return "test"
    if isinstance(p, ast.BoolOp):
        return "test"
    if isinstance(p, ast.Compare) and len(p.ops) == 1 and isinstance(p.ops[0], (ast.Is, ast.IsNot)) \
            and isinstance(p.comparators[0], ast.Constant) and p.comparators[0].value is None:
        return "test"
    return "other"


def attr_uses(cls: type, attr: str) -> Optional[list[Use]]:
    """Every read of `self.<attr>` in the methods of cls (and its bases outside torch), with its
    kind; None when some method's source cannot be read (then nothing can be said)."""
    uses = []
    for name, fn in _methods(cls):
        node = _function_ast(fn)
        if node is None:
            return None
        parents = _parents(node)
        found = sorted((n for n in ast.walk(node) if _is_self_attr(n, attr)), key=lambda n: (n.lineno, n.col_offset))
        for n in found:  # in source order
            p = parents.get(n)
            shown = p if isinstance(p, (ast.Call, ast.Subscript, ast.Compare)) else n
            uses.append(Use(name, _use_kind(n, parents), ast.unparse(shown)[:80], _guards(n, parents)))
    return uses


def _guards(node, parents: dict) -> tuple:
    out, child, p = [], node, parents.get(node)
    while p is not None:
        if isinstance(p, ast.If) and child is not p.test:
            test = ast.unparse(p.test)
            out.append(test if any(child is s for s in p.body) else f"not ({test})")
        child, p = p, parents.get(p)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# norm then activation, back to back
# ---------------------------------------------------------------------------------------------
def _call_stmt(stmt, attr: str):
    """(target name, call) if stmt is `v = self.<attr>(...)`, else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
            and isinstance(stmt.value, ast.Call) and _is_self_attr(stmt.value.func, attr):
        return stmt.targets[0].id, stmt.value
    return None


def _blocks(fn_node):
    """(statement, its block (a list), the chain of (If statement, block holding it) above)."""
    out = []

    def walk(block, chain):
        for stmt in block:
            out.append((stmt, block, chain))
            if isinstance(stmt, ast.If):
                walk(stmt.body, chain + [(stmt, block)])
                walk(stmt.orelse, chain + [(stmt, block)])
            elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)):
                for field in ("body", "orelse", "finalbody"):
                    walk(getattr(stmt, field, []) or [], chain + [(stmt, block)])
                for h in getattr(stmt, "handlers", []) or []:
                    walk(h.body, chain + [(stmt, block)])

    walk(fn_node.body, [])
    return out


def _next_stmt(stmt, block, chain):
    """The statement that runs after `stmt` (through the ends of if/else branches), or None
    (the function's end, or a loop, with or try around it: not followed)."""
    i = next(k for k, s in enumerate(block) if s is stmt)
    if i + 1 < len(block):
        return block[i + 1]
    if not chain:
        return None
    parent, parent_block = chain[-1]
    if not isinstance(parent, ast.If):
        return None
    return _next_stmt(parent, parent_block, chain[:-1])


def _last_stmts(stmt) -> list:
    """The statements that can run last within `stmt` (an if/else: the ends of its branches;
    an if without else also falls through: None stands for that)."""
    if isinstance(stmt, ast.If):
        ends = _last_stmts(stmt.body[-1])
        ends += _last_stmts(stmt.orelse[-1]) if stmt.orelse else [None]
        return ends
    return [stmt]


def back_to_back(cls: type, norm: str, act: str) -> Optional[str]:
    """None when cls's methods apply `self.<act>` exactly to what `self.<norm>` returns, right
    after it and to nothing else: every `v = self.<norm>(...)` is followed (through if/else
    ends) by `v = self.<act>(v)`, every `self.<act>` call is such a follow-up, and neither is
    read otherwise (truth tests `if self.<norm>:` aside). Else the reason it is not so."""
    uses_n, uses_a = attr_uses(cls, norm), attr_uses(cls, act)
    if uses_n is None or uses_a is None:
        return f"the source of {cls.__name__}'s methods cannot be read"
    others = [u for u in uses_n + uses_a if u.kind == "other"]
    if others:
        return f"{cls.__name__}.{others[0].method} uses {others[0].what!r} other than by calling it"
    methods = {u.method for u in uses_n + uses_a if u.kind == "call"}
    if not any(u.kind == "call" for u in uses_n):
        return f"{cls.__name__} never calls self.{norm}"
    if len(methods) != 1:
        return f"self.{norm} and self.{act} are called in several methods ({', '.join(sorted(methods))})"
    (method,) = methods
    node = _function_ast(next(fn for name, fn in _methods(cls) if name == method))
    stmts = _blocks(node)
    norm_calls = [(s, b, c) for s, b, c in stmts if _call_stmt(s, norm)]
    act_calls = [(s, b, c) for s, b, c in stmts if _call_stmt(s, act)]
    n_calls = sum(1 for u in uses_n if u.kind == "call")
    a_calls = sum(1 for u in uses_a if u.kind == "call")
    if len(norm_calls) != n_calls or len(act_calls) != a_calls:
        return f"{cls.__name__}.{method} calls self.{norm} or self.{act} other than as `v = self.{{attr}}(...)`"
    for s, b, c in norm_calls:
        v = _call_stmt(s, norm)[0]
        nxt = _next_stmt(s, b, c)
        got = _call_stmt(nxt, act) if nxt is not None else None
        if got is None or got[0] != v or len(got[1].args) != 1 or got[1].keywords \
                or not (isinstance(got[1].args[0], ast.Name) and got[1].args[0].id == v):
            return f"in {cls.__name__}.{method}, `{ast.unparse(s)}` is not followed by `{v} = self.{act}({v})`"
    for s, b, c in act_calls:
        i = next(k for k, x in enumerate(b) if x is s)
        if i == 0:
            return f"in {cls.__name__}.{method}, `{ast.unparse(s)}` opens a block (not after self.{norm})"
        v, call = _call_stmt(s, act)
        if len(call.args) != 1 or call.keywords or not (isinstance(call.args[0], ast.Name) and call.args[0].id == v):
            return f"in {cls.__name__}.{method}, `{ast.unparse(s)}` applies self.{act} to something else than {v}"
        for prev in _last_stmts(b[i - 1]):
            got = _call_stmt(prev, norm) if prev is not None else None
            if got is None or got[0] != v:
                return f"in {cls.__name__}.{method}, `{ast.unparse(s)}` can run after something else than self.{norm}"
    return None


__all__ = ["Use", "attr_uses", "back_to_back", "class_fingerprint", "fingerprint", "source_fingerprint"]
