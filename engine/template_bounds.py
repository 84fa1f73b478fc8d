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
  already bounds `range` to 100,000 items.
- time: `render_bounded` runs the render in a thread and stops it (an exception raised
  into it) after `TEMPLATE_SECONDS`.

Not bounded by size: Python's own `str.format` width inside a format string.
"""

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils import chat_template_utils

MAX_TEMPLATE_CHARS = 1 << 24  # 16 Mi characters: far above any real prompt's text
MAX_POWER_BITS = 1 << 12  # an integer power of at most 4096 bits
TEMPLATE_SECONDS = 10.0

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


def _bounded_filter(name: str, f: Callable) -> Callable:
    @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment markers
    def bounded(*args, **kwargs):
        _check_args(f"the filter {name}", args[1:], kwargs)
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

    intercepted_binops = frozenset({"*", "+", "**"})
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
        if operator == "**" and type(left) is int and type(right) is int and right > 0:
            if abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                raise TemplateLimitError(
                    f"{left} ** {right}: above the chat template bound of {MAX_POWER_BITS} bits"
                )
        return super().call_binop(context, operator, left, right)

    # jinja2's own signature: prefixed names leave every keyword to the called function
    def call(__self, __context, __obj, *args, **kwargs):
        """A call from the template, refused when an integer argument is too large
        (e.g. `'x'.ljust(10**10)`)."""
        _check_args(f"a call of {getattr(__obj, '__name__', 'a function')}", args, kwargs)
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
