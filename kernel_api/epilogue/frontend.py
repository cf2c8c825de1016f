"""The front end: an epilogue function (or its source string) to an `EpilogueGraph`.

The function is parsed, never run: its body is a small language of assignments (each name
assigned once), one ``return`` of names, and expressions over the parameters built from
``+ - * /``, unary minus, number literals and the functions of `FUNCTIONS`. A function may be
spelled bare (``relu(x)``) or through a module (``torch.relu(x)``, ``F.gelu(x)``), so an
epilogue written against torch also runs as plain torch code. The first parameter is
``accum``, the GEMM's accumulator; the others bind to tensors and scalars by name. The
returned names bind to outputs: ``D`` is the GEMM's output, the others extra outputs.

Anything else raises `EpilogueError` naming the node and its line.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Callable

from ..core.numbers import is_finite_number
from .errors import EpilogueError
from .ir import (ACCUM, BINARY, CAST, INPUT, LITERAL, REDUCE, UNARY, EpilogueGraph, Node)

_UNARY_NAMES = {"identity": "identity", "neg": "neg", "negative": "neg", "relu": "relu", "gelu": "gelu",
                "gelu_tanh": "gelu_tanh", "silu": "silu", "sigmoid": "sigmoid", "tanh": "tanh", "exp": "exp",
                "abs": "abs", "hardswish": "hardswish"}
_BINARY_NAMES = {"add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul", "div": "div",
                 "divide": "div", "true_divide": "div", "maximum": "max", "minimum": "min"}
_REDUCE_NAMES = {"sum": "sum", "amax": "max", "amin": "min"}
_CAST_NAMES = {"float16": "f16", "half": "f16", "f16": "f16", "bfloat16": "bf16", "bf16": "bf16",
               "float32": "f32", "float": "f32", "f32": "f32"}
#: Every function name the front end knows (``max``/``min``: two arguments are elementwise,
#: one argument, optionally with ``dim=``, a reduction; ``multiply_add(a, b, c)`` is a*b + c;
#: ``cast(x, "f16")`` and ``x.to(torch.float16)`` round to a type).
FUNCTIONS = tuple(sorted({*_UNARY_NAMES, *_BINARY_NAMES, *_REDUCE_NAMES, "max", "min", "multiply_add", "cast"}))
_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}


def source_of(fn_or_source: Callable | str) -> tuple[str, int, str | None]:
    """(source text, line offset of its first line in its file, file name) of a function or a
    source string (offset 0)."""
    if isinstance(fn_or_source, str):
        return fn_or_source, 0, None
    if not callable(fn_or_source):
        raise EpilogueError(f"expected a function or its source string, got {type(fn_or_source).__name__}")
    code = getattr(fn_or_source, "__code__", None)
    if getattr(fn_or_source, "__name__", "") == "<lambda>":
        raise EpilogueError("a lambda cannot be parsed as an epilogue; write it with def",
                            line=getattr(code, "co_firstlineno", None))
    try:
        lines, first = inspect.getsourcelines(fn_or_source)
    except (OSError, TypeError) as exc:
        raise EpilogueError(f"the source of {getattr(fn_or_source, '__name__', fn_or_source)!r} is not available "
                            f"({exc}); pass it as a source string") from None
    return textwrap.dedent("".join(lines)), max(first - 1, 0), inspect.getsourcefile(fn_or_source)


def parse(fn_or_source: Callable | str) -> EpilogueGraph:
    """The `EpilogueGraph` of an epilogue function or its source string."""
    source, offset, _ = source_of(fn_or_source)
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise EpilogueError(f"syntax error: {exc.msg}", line=(exc.lineno or 0) + offset,
                            node=(exc.text or "").strip() or None) from None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(defs) != 1:
        raise EpilogueError(f"expected one function definition, found {len(defs)}",
                            line=1 + offset if not defs else defs[1].lineno + offset)
    return _Builder(source, offset, defs[0]).build()


class _Builder:
    def __init__(self, source: str, offset: int, fn: ast.FunctionDef) -> None:
        self.source, self.offset, self.fn = source, offset, fn
        self.nodes: list[Node] = []
        self.index: dict[tuple, int] = {}  # structure -> node (common subexpressions once)
        self.env: dict[str, int] = {}
        self.assigned: set[str] = set()

    # ---- messages
    def error(self, message: str, at: ast.AST | None) -> EpilogueError:
        line = getattr(at, "lineno", None)
        text = ast.get_source_segment(self.source, at) if at is not None else None
        if text is not None:
            text = " ".join(text.split())
            if len(text) > 80:
                text = text[:77] + "..."
        return EpilogueError(message, function=self.fn.name, line=None if line is None else line + self.offset,
                             node=text)

    def add(self, node: Node, at: ast.AST) -> int:
        key = (node.kind, node.args, node.attr if node.kind != LITERAL else ("literal", repr(node.attr)))
        found = self.index.get(key)
        if found is not None:
            return found
        text = ast.get_source_segment(self.source, at)
        node = Node(node.kind, node.args, node.attr, at.lineno + self.offset, " ".join(text.split()) if text else None)
        self.nodes.append(node)
        self.index[key] = len(self.nodes) - 1
        return len(self.nodes) - 1

    # ---- the function
    def build(self) -> EpilogueGraph:
        fn = self.fn
        a = fn.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
            raise self.error("parameters must be plain names (no *args, **kwargs, defaults or keyword-only)", fn)
        names = [p.arg for p in a.args]
        if not names or names[0] != "accum":
            raise self.error(f"the first parameter must be named accum (the GEMM's accumulator), got "
                             f"{names[0] if names else 'none'}", fn)
        if len(set(names)) != len(names):
            raise self.error("a parameter name repeats", fn)
        self.env["accum"] = self.add(Node(ACCUM), a.args[0])
        params = tuple(names[1:])
        for i, p in enumerate(a.args[1:]):
            self.env[p.arg] = self.add(Node(INPUT, attr=i), p)
        body = list(fn.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        outputs = None
        for stmt in body:
            if outputs is not None:
                raise self.error("statements after return", stmt)
            if isinstance(stmt, ast.Assign):
                self.assign(stmt)
            elif isinstance(stmt, ast.Return):
                outputs = self.returns(stmt)
            elif isinstance(stmt, ast.Pass):
                continue
            elif isinstance(stmt, ast.AugAssign):
                raise self.error("augmented assignment reassigns a name; each name is assigned once", stmt)
            else:
                raise self.error(f"unsupported statement ({type(stmt).__name__}); an epilogue holds assignments "
                                 f"and one return", stmt)
        if outputs is None:
            raise self.error("no return statement; return D (and any extra outputs)", fn)
        self.check_reductions(outputs)
        return EpilogueGraph(params, tuple(self.nodes), tuple(outputs), fn.name, self.source)

    def assign(self, stmt: ast.Assign) -> None:
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            raise self.error("assign to one name at a time", stmt)
        name = stmt.targets[0].id
        if name in self.assigned:
            raise self.error(f"{name!r} is assigned twice; each name is assigned once", stmt)
        if name in self.env:
            raise self.error(f"{name!r} is a parameter and cannot be reassigned", stmt)
        index = self.expr(stmt.value)
        self.assigned.add(name)
        self.env[name] = index

    def returns(self, stmt: ast.Return) -> list[tuple[str, int]]:
        value = stmt.value
        items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value] if value is not None else []
        outputs = []
        for item in items:
            if not isinstance(item, ast.Name):
                raise self.error("return names only (assign the expression to a name first)", item)
            if item.id not in self.env:
                raise self.error(f"unknown name {item.id!r}", item)
            index = self.env[item.id]
            if self.nodes[index].kind == INPUT:
                raise self.error(f"{item.id!r} is an input; an output is accum or a computed value", item)
            if any(n == item.id for n, _ in outputs):
                raise self.error(f"{item.id!r} is returned twice", item)
            outputs.append((item.id, index))
        if not any(n == "D" for n, _ in outputs):
            raise self.error("the return must name D, the GEMM's output", stmt)
        return outputs

    def check_reductions(self, outputs: list[tuple[str, int]]) -> None:
        returned = {i for _, i in outputs}
        for i, node in enumerate(self.nodes):
            if node.kind == REDUCE and i not in returned:
                raise EpilogueError("a reduction must be returned as an output", function=self.fn.name,
                                    line=node.line, node=node.text)
        d = dict(outputs)["D"]
        if self.nodes[d].kind == REDUCE:
            node = self.nodes[d]
            raise EpilogueError("D is the GEMM's (M, N) output and cannot be a reduction", function=self.fn.name,
                                line=node.line, node=node.text)

    # ---- expressions
    def operand(self, e: ast.AST) -> int:
        index = self.expr(e)
        if self.nodes[index].kind == REDUCE:
            raise self.error("a reduction's result is an output only; it cannot feed another node", e)
        return index

    def expr(self, e: ast.AST) -> int:
        if isinstance(e, ast.Name):
            if e.id not in self.env:
                raise self.error(f"unknown name {e.id!r}", e)
            return self.env[e.id]
        if isinstance(e, ast.Constant):
            if isinstance(e.value, bool) or not isinstance(e.value, (int, float)):
                raise self.error(f"unsupported literal {e.value!r}; numbers only", e)
            if not is_finite_number(e.value):
                raise self.error("a literal outside the finite float range", e)
            return self.add(Node(LITERAL, attr=float(e.value)), e)
        if isinstance(e, ast.UnaryOp):
            if isinstance(e.op, ast.UAdd):
                return self.operand(e.operand)
            if isinstance(e.op, ast.USub):
                if isinstance(e.operand, ast.Constant) and is_finite_number(e.operand.value):
                    return self.add(Node(LITERAL, attr=-float(e.operand.value)), e)
                return self.add(Node(UNARY, (self.operand(e.operand),), "neg"), e)
            raise self.error(f"unsupported operator {type(e.op).__name__}", e)
        if isinstance(e, ast.BinOp):
            op = _BINOPS.get(type(e.op))
            if op is None:
                raise self.error(f"unsupported operator {type(e.op).__name__}; expected + - * /", e)
            return self.add(Node(BINARY, (self.operand(e.left), self.operand(e.right)), op), e)
        if isinstance(e, ast.Call):
            return self.call(e)
        raise self.error(f"unsupported expression ({type(e).__name__})", e)

    def call(self, e: ast.Call) -> int:
        func = e.func
        if isinstance(func, ast.Attribute) and func.attr == "to" and not _is_module_path(func.value):
            if len(e.args) != 1 or e.keywords:
                raise self.error("x.to(dtype) takes one dtype", e)
            return self.cast(self.operand(func.value), e.args[0], e)
        name = _function_name(func)
        if name is None:
            raise self.error("call a function by name (relu(x), torch.relu(x))", e)
        kw = {k.arg: k.value for k in e.keywords}
        if name in _UNARY_NAMES:
            op = _UNARY_NAMES[name]
            if op == "gelu" and "approximate" in kw:
                approx = kw.pop("approximate")
                if not (isinstance(approx, ast.Constant) and approx.value in ("tanh", "none")):
                    raise self.error("gelu's approximate must be 'tanh' or 'none'", e)
                op = "gelu_tanh" if approx.value == "tanh" else "gelu"
            self.arity(e, name, 1, kw)
            return self.add(Node(UNARY, (self.operand(e.args[0]),), op), e)
        if name in _BINARY_NAMES:
            self.arity(e, name, 2, kw)
            return self.add(Node(BINARY, (self.operand(e.args[0]), self.operand(e.args[1])), _BINARY_NAMES[name]), e)
        if name in ("max", "min") and len(e.args) == 2 and not kw:
            return self.add(Node(BINARY, (self.operand(e.args[0]), self.operand(e.args[1])), name), e)
        if name in _REDUCE_NAMES or name in ("max", "min"):
            op = _REDUCE_NAMES.get(name, name)
            axis = self.axis(kw.pop("dim", None), e)
            kw.pop("keepdim", None)
            self.arity(e, name, 1, kw)
            return self.add(Node(REDUCE, (self.operand(e.args[0]),), (op, axis)), e)
        if name == "multiply_add":
            self.arity(e, name, 3, kw)
            a, b, c = (self.operand(x) for x in e.args)
            product = self.add(Node(BINARY, (a, b), "mul"), e.args[0])
            return self.add(Node(BINARY, (product, c), "add"), e)
        if name == "cast":
            self.arity(e, name, 2, kw)
            return self.cast(self.operand(e.args[0]), e.args[1], e)
        raise self.error(f"unknown function {name!r}; expected one of {', '.join(FUNCTIONS)}", e)

    def arity(self, e: ast.Call, name: str, n: int, kw: dict) -> None:
        if kw:
            raise self.error(f"{name}: unexpected keyword {next(iter(kw))!r}", e)
        if len(e.args) != n or any(isinstance(a, ast.Starred) for a in e.args):
            raise self.error(f"{name} takes {n} argument{'s' if n > 1 else ''}, got {len(e.args)}", e)

    def axis(self, dim: ast.AST | None, e: ast.Call) -> str | None:
        """Reduce along N ("row": one value per row), along M ("column") or both ("all")."""
        if dim is None:
            return None
        try:
            value = ast.literal_eval(dim)
        except ValueError:
            raise self.error("dim must be a literal: 0, 1, -1, [0], [1] or [0, 1]", e) from None
        dims = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise self.error("dim must be a literal: 0, 1, -1, [0], [1] or [0, 1]", e)
        norm = frozenset(d % 2 if d in (-1, -2, 0, 1) else 9 for d in dims)
        if norm == {1}:
            return "row"
        if norm == {0}:
            return "column"
        if norm == {0, 1}:
            return "all"
        raise self.error(f"dim={value!r}: an epilogue reduces along M (0), N (1) or both", e)

    def cast(self, value: int, target: ast.AST, e: ast.Call) -> int:
        name = _function_name(target) if not isinstance(target, ast.Constant) else target.value
        dtype = _CAST_NAMES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise self.error(f"cast to an unsupported type; expected one of {sorted(set(_CAST_NAMES))}", e)
        return self.add(Node(CAST, (value,), dtype), e)


def _function_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and _is_module_path(func.value):
        return func.attr
    return None


def _is_module_path(value: ast.AST) -> bool:
    """``torch``, ``F``, ``torch.nn.functional``: a dotted chain of names (a module, by the
    convention that variables in an epilogue are not objects with methods)."""
    while isinstance(value, ast.Attribute):
        value = value.value
    return isinstance(value, ast.Name) and value.id in ("torch", "F", "nn", "functional", "math", "np", "ops")


def parse_cached(fn_or_source: Any) -> EpilogueGraph:
    """`parse`, remembered per function object or source string (a call per GEMM must not
    re-read the source)."""
    key = fn_or_source if isinstance(fn_or_source, str) else getattr(fn_or_source, "__code__", fn_or_source)
    try:
        found = _PARSED.get(key)
    except TypeError:
        return parse(fn_or_source)
    if found is None:
        found = parse(fn_or_source)
        if len(_PARSED) >= _PARSED_LIMIT:
            _PARSED.clear()
        _PARSED[key] = found
    return found


_PARSED: dict[Any, EpilogueGraph] = {}
_PARSED_LIMIT = 1024
