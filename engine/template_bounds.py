"""Bounds on rendering a model's chat template, which is untrusted code.

transformers renders chat templates in jinja2's immutable sandbox, which keeps a template
from reaching the interpreter but not from building a huge string (`{{ 'x' * 10**10 }}`
grew a process to about 10 GB) or looping for ever. Two bounds are added here:

- size: the sandbox transformers builds is this module's `BoundedSandbox` (installed
  into transformers when this module is imported), which refuses any repetition,
  concatenation with `+` or `~`, power, call or filter whose result or argument would
  exceed `MAX_TEMPLATE_CHARS` characters (or a number of more than `MAX_POWER_BITS`
  bits) before computing it, and a rendered prompt past `MAX_TEMPLATE_CHARS` (a string
  within the bound output many times in a loop) before joining it; jinja2's own sandbox
  already bounds `range` to 100,000 items. The string operations that build more than
  their operands hold are bounded by the size of their result, computed from the
  operands before the operation: `%` formatting and the `format` filter (widths,
  precisions, conversions), `str.format` / `format_map` (the widths of their fields),
  `replace` (method and filter), `join` (method and filter), `translate`, `expandtabs`
  and the `indent` filter; `tojson`'s indent and separators are bounded to
  `MAX_JSON_INDENT` characters.
- time: `render_bounded` runs the render in a thread and stops it (an exception raised
  into it) after `TEMPLATE_SECONDS`.
"""

import ctypes
import functools
import re
import string
import threading
from collections.abc import Callable
from typing import TypeVar

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg
from transformers.utils import chat_template_utils

MAX_TEMPLATE_CHARS = 1 << 24  # 16 Mi characters: far above any real prompt's text
MAX_POWER_BITS = 1 << 12  # an integer power of at most 4096 bits
MAX_JSON_INDENT = 1 << 10  # tojson's indent and separators (templates use 2 or 4)
# The most characters one number can format to (an integer of MAX_POWER_BITS bits has
# 1,234 digits, a float's %f 309 before its point); widths and precisions count apart.
MAX_NUMBER_CHARS = 1 << 12
TEMPLATE_SECONDS = 10.0

# A printf-style conversion: its width and precision (a number, or * for an argument).
_PRINTF = re.compile(
    r"%(?:\([^)]*\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?[hlL]?"
    r"(?P<kind>[diouxXeEfFgGcrsa%])"
)

T = TypeVar("T")


class TemplateLimitError(SecurityError):
    """A chat template went past a size or time bound of this module; the message says
    which and how far."""


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_args(what: str, args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(
                f"{what} with the number {value}: above the chat template bound of "
                f"{MAX_TEMPLATE_CHARS} characters"
            )


def _refuse_past(what: str, size: int) -> None:
    if size > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(
            f"{what} of {size} characters: above the chat template bound of {MAX_TEMPLATE_CHARS}"
        )


def _number(digits: str) -> int:
    """A width or precision as written (Python converts no more than 4300 digits: a
    longer one counts as 10**18, far past the bound)."""
    return int(digits) if len(digits) <= 18 else 10**18


def _longest(values) -> int:
    return max((len(v) if isinstance(v, str) else len(str(v)) for v in values), default=0)


def _printf_size(fmt: str, right) -> int:
    """The most characters `fmt % right` can produce: the format's own text, each
    conversion's width and precision (`*` takes them from the arguments), and each
    conversion as long as the longest argument (a mapping key can repeat one)."""
    values = right.values() if isinstance(right, dict) else right
    values = list(values) if isinstance(values, (tuple, list, type({}.values()))) else [values]
    _check_args("a % format", values, {})  # the numbers * takes
    conversions = list(_PRINTF.finditer(fmt))
    widths = sum(
        _number(m[g]) for m in conversions for g in ("width", "precision") if m[g] and m[g] != "*"
    )
    stars = sum(1 for m in conversions for g in ("width", "precision") if m[g] == "*")
    return len(fmt) + widths + (len(conversions) + stars) * max(_longest(values), MAX_NUMBER_CHARS)


def _format_size(fmt: str, args, kwargs) -> int:
    """The most characters `fmt.format(*args, **kwargs)` can produce: the format's own
    text, every number in its fields' specs (widths, precisions) and each field as long
    as the longest argument; counting stops once past the bound, so a format of millions
    of fields is refused without holding them all (`string.Formatter.parse` yields them
    one at a time)."""
    values = [*args, *kwargs.values()]
    if len(values) == 1 and isinstance(values[0], dict):  # format_map
        values = list(values[0].values())
    field = max(_longest(values), MAX_NUMBER_CHARS)
    size = len(fmt)
    try:
        for _, _, spec, _ in string.Formatter().parse(fmt):
            size += field + (sum(_number(d) for d in re.findall(r"\d+", spec)) if spec else 0)
            if size > MAX_TEMPLATE_CHARS:
                break
    except ValueError:
        return len(fmt)  # the call raises its own error
    return size


def _replace_size(s: str, old, new, count=None) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(s)
    places = s.count(old) if old else len(s) + 1
    if type(count) is int and count >= 0:
        places = min(places, count)
    return len(s) + places * max(0, len(new) - len(old))


def _join_size(sep: str, items: list) -> int:
    return sum(len(str(i)) for i in items) + len(sep) * max(0, len(items) - 1)


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuses a call of `s.name(*args, **kwargs)` whose result would pass the bound;
    returns the arguments to call it with (an iterator `join` takes, as a list)."""
    what = f"str.{name}"
    if name in ("format", "format_map"):
        _refuse_past(what, _format_size(s, args, kwargs))
    elif name == "replace" and len(args) >= 2:
        _refuse_past(what, _replace_size(s, *args[:3]))
    elif name == "join" and args:
        items = list(args[0])
        _refuse_past(what, _join_size(s, items))
        args = (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        _refuse_past(what, len(s) * max(1, _longest(args[0].values())))
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if type(size) is int:
            _refuse_past(what, len(s) + s.count("\t") * size)
    return args


def _check_filter(name: str, values: tuple, kwargs: dict) -> None:
    """Refuses a filter call (the filtered value and its arguments: `values`) whose
    result would pass the bound."""
    what = f"the filter {name}"
    if not values:
        return
    value, rest = values[0], values[1:]
    if name == "format":
        _refuse_past(what, _printf_size(str(value), kwargs or rest))
    elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
        _refuse_past(what, _replace_size(value, *rest[:3]))
    elif name == "indent" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if type(width) is int else 0
        _refuse_past(what, len(value) + (value.count("\n") + 1) * width)
    elif name == "tojson":
        indent = rest[1] if len(rest) > 1 else kwargs.get("indent")
        separators = rest[2] if len(rest) > 2 else kwargs.get("separators")
        sizes = [len(indent) if isinstance(indent, str) else indent if type(indent) is int else 0]
        sizes += [len(x) for x in separators or () if isinstance(x, str)]
        if max(sizes) > MAX_JSON_INDENT:
            raise TemplateLimitError(
                f"{what} with an indent or separator of {max(sizes)} characters: above the "
                f"chat template bound of {MAX_JSON_INDENT}"
            )


def _bounded_filter(name: str, f: Callable) -> Callable:
    # a filter marked pass_context / pass_eval_context / pass_environment gets that first
    skip = 0 if _PassArg.from_obj(f) is None else 1

    @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment markers
    def bounded(*args, **kwargs):
        _check_args(f"the filter {name}", args[1:], kwargs)
        if name == "join" and len(args) > skip:  # an iterator is taken once: as a list
            items = list(args[skip])
            sep = args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")
            if "attribute" not in kwargs and len(args) <= skip + 2:
                _refuse_past(f"the filter {name}", _join_size(str(sep), items))
            args = (*args[:skip], items, *args[skip + 1 :])
        else:
            _check_filter(name, args[skip:], kwargs)
        return f(*args, **kwargs)

    return bounded


class _BoundedFilters(dict):
    """The environment's filters, each wrapped by `_bounded_filter` as it is added
    (transformers adds its own `tojson` after building the environment)."""

    def __init__(self, filters: dict):
        super().__init__()
        for name, f in filters.items():
            self[name] = f

    def __setitem__(self, name: str, f: Callable) -> None:
        super().__setitem__(name, _bounded_filter(name, f))


def _bounded_text(what: str, parts) -> list[str]:
    """`parts` as a list, refused once their text's total length (`str` of each) passes
    `MAX_TEMPLATE_CHARS`: the bound of a join, checked before joining."""
    out, total = [], 0
    for part in parts:
        text = str(part)
        total += len(text)
        if total > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(
                f"{what} of more than {MAX_TEMPLATE_CHARS} characters: above the chat "
                "template bound"
            )
        out.append(part)
    return out


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with `a ~ b` compiled through
    `BoundedSandbox.bounded_join` (jinja2 compiles it to a join the environment cannot
    intercept otherwise): a template doubling a string with `~` in a loop grew to GBs."""

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.bounded_join({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose `*`, `+` and `**`, calls and filters refuse
    results or arguments past `MAX_TEMPLATE_CHARS` / `MAX_POWER_BITS` (raising
    `TemplateLimitError`) before computing them."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    @staticmethod
    def concat(parts) -> str:
        """The rendered text (jinja2 joins a template's output with this), refused past
        `MAX_TEMPLATE_CHARS`: a string within the bound output in a loop grew the
        prompt to GBs."""
        return "".join(_bounded_text("a rendered prompt", parts))

    @staticmethod
    def bounded_join(join: Callable, parts: tuple) -> str:
        """`a ~ b ~ ...` (joined by jinja2's `join`), refused past `MAX_TEMPLATE_CHARS`."""
        return join(_bounded_text("a join with ~", parts))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.filters = _BoundedFilters(self.filters)

    def call_binop(self, context, operator: str, left, right):
        """`left operator right`, refused when its result would be too large."""
        sizes = (_size(left), _size(right))
        if operator == "*" and None in sizes and sizes != (None, None):
            count = right if sizes[0] is not None else left
            length = sizes[0] if sizes[0] is not None else sizes[1]
            if type(count) is int and length * count > MAX_TEMPLATE_CHARS:
                raise TemplateLimitError(
                    f"a repetition of {length} x {count} items: above the chat template "
                    f"bound of {MAX_TEMPLATE_CHARS}"
                )
        if operator == "+" and None not in sizes and sum(sizes) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(
                f"a concatenation of {sum(sizes)} items: above the chat template bound of "
                f"{MAX_TEMPLATE_CHARS}"
            )
        if operator == "%" and isinstance(left, str):
            _refuse_past("a % format", _printf_size(left, right))
        if operator == "**" and type(left) is int and type(right) is int and right > 0:
            if abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                raise TemplateLimitError(
                    f"{left} ** {right}: above the chat template bound of {MAX_POWER_BITS} bits"
                )
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):
        """jinja2's sandboxed `str.format` / `format_map` (made where the template reads
        the method, so that every call of it is sandboxed), refused when its result
        would pass the bound (`'{:>2000000000}'.format('x')`)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        @functools.wraps(wrapped)
        def bounded(*args, **kwargs):
            _check_str_method(value.__self__, value.__name__, args, kwargs)
            return wrapped(*args, **kwargs)

        return bounded

    # jinja2's own signature: prefixed names leave every keyword to the called function
    def call(__self, __context, __obj, *args, **kwargs):
        """A call from the template, refused when an integer argument is too large
        (e.g. `'x'.ljust(10**10)`) or a string method would build more than the bound
        (`'{:>2000000000}'.format('x')`, `s.replace('x', 'x' * 300)`)."""
        _check_args(f"a call of {getattr(__obj, '__name__', 'a function')}", args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


# transformers builds its sandbox by this name when it compiles a template.
chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox


class _Stop(Exception):
    """Raised into a render thread past its time bound."""


def render_bounded(render: Callable[[], T], seconds: float | None = None) -> T:
    """`render()` (a chat template's rendering) run in a thread, stopped after `seconds`
    (default `TEMPLATE_SECONDS`).

    Raises:
        TemplateLimitError: it ran past `seconds` (it is then stopped at its next
            Python step; a single huge operation is refused by `BoundedSandbox`).
        Exception: whatever `render` raised.
    """
    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = render()
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            out["error"] = e

    thread = threading.Thread(target=run, name="chat-template", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_Stop)
        )
        thread.join(1.0)
        raise TemplateLimitError(f"rendering took more than {seconds:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]
