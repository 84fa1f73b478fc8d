"""The flags of every front end (the CLI, the server, the app), defined once.

`add_cache_flags(parser)` adds one argparse group whose help shows each flag's default;
`stream_config(args)` builds the `StreamConfig`: its defaults, then the environment
variables (`ENV_FIELDS`, read here and nowhere else), then the flags given. The renamed
flags `--spec-slots` and `--prefill-chunk` still parse (hidden, with a warning).
`describe` words a `ConfigError` in a front end's names (`config_error_message`: the
flag's or the environment variable's). The argparse types of the flags front ends share
(`positive_int` for --max-tokens, `prompt_text`, `temperature`, `top_p`, `port`, `seed`)
refuse bad values while parsing, and `Parser` says so in one line.
"""

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from engine.config import (
    AUTO_MEMORY_FRACTION,
    EVICTION_POLICIES,
    ConfigError,
    StreamConfig,
    check_sampling,
    parse_memory,
)

# The environment variables the cache reads, and the StreamConfig field each one sets.
ENV_FIELDS = {
    "EXPERT_SLOTS": "expert_slots",
    "SIDEREGION_LFU": "side_lfu",
    "SIDEREGION_SYNC": "sync",
    "AUTOPIN_BUDGET_FRAC": "autopin_frac",
    "PREFILL_CHUNK": "scratch_slots",
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag and the value, with
    where to look (the usage of a command with every cache flag runs to 16 lines). A
    value such as "-5GiB" is a value, as "-5" is: its flag's own check refuses it by
    name, not argparse's "expected one argument"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)\s*[A-Za-z]*$")

    def error(self, message: str):
        # a flag by its long name only, where argparse joins its spellings ("--max-tokens/-m")
        message = re.sub(r"^argument (--[\w-]+)(/-\w+)+:", r"argument \1:", message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _memory(text: str) -> int | str:
    """parse_memory for argparse: its message instead of "invalid value"."""
    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host_memory(text: str) -> int | str:
    """--host-memory: a size as --expert-memory takes it, "auto", or "off" or a size of
    nothing (0, 0B, 0GiB: 0)."""
    if text.strip().lower() == "off":
        return 0
    try:
        return _memory(text)
    except argparse.ArgumentTypeError as e:
        if not str(e).startswith("must be > 0"):
            raise
        if "-" in text:  # parse_memory's "> 0" would contradict the 0 this flag takes
            raise argparse.ArgumentTypeError(f"must be >= 0 (0: off), got {text!r}") from None
        return 0  # parse_memory refuses a size below one byte; here it means off


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (--max-tokens, --max-queue, ...)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def prompt_text(text: str) -> str:
    """An argparse type: a prompt that is not empty (nor only whitespace)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the text to continue (or to answer)")
    return text


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {text!r}")
    return value


def seed(text: str) -> int:
    """An argparse type: an MLX random seed, an integer in [0, 2**64 - 1] (the range the
    server's `seed` takes)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**64 - 1], got {text!r}")
    return value


def _sampling(field: str):
    """An argparse type of one `check_sampling` field."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        try:
            check_sampling(**{field: value})
        except ConfigError as e:
            raise argparse.ArgumentTypeError(f"{e.what}, got {text!r}") from None
        return value

    return parse


temperature = _sampling("temperature")
top_p = _sampling("top_p")


@dataclass(frozen=True)
class Flag:
    """One cache flag: `name` sets StreamConfig `field`; `kind` parses its value (None:
    an on/off pair `--x/--no-x`); `choices` limits it; `deprecated` are old spellings."""

    name: str
    field: str
    kind: type | None
    help: str
    choices: tuple = ()
    deprecated: tuple = ()


FLAGS = (
    Flag("--expert-slots", "expert_slots", int, "real-region slots per MoE layer"),
    Flag(
        "--expert-memory",
        "expert_memory",
        _memory,
        "memory for the real regions of all layers (6GiB, 512MiB, 8GB, 10G for 10 GiB, or auto: "
        f"{AUTO_MEMORY_FRACTION * 100:.0f}%% of the memory available at start), slots per "
        "layer by its record size; instead of --expert-slots",
    ),
    Flag(
        "--host-memory",
        "host_memory",
        _host_memory,
        "page-locked host memory that keeps experts read from disk for the GPU pools "
        "(CUDA; 24GiB, auto: every expert, up to "
        f"{AUTO_MEMORY_FRACTION * 100:.0f}%% of the memory available, or off)",
    ),
    Flag(
        "--side-slots",
        "side_slots",
        int,
        "side-region rows per bank (2 banks, both holding predictions with --lfu) and experts "
        "per prediction (the first MoE layer, which no layer predicts, holds its rows as "
        "real slots); a value > 0 turns --prefetch on unless given",
        deprecated=("--spec-slots",),
    ),
    Flag("--prefetch", "prefetch", None, "predict the next layers' experts into the side region"),
    Flag(
        "--adaptive-prefetch",
        "adaptive_prefetch",
        None,
        "each layer's fills per prediction decided at run time, up to --side-slots, from "
        "how often its predictions are routed to and the forward times measured "
        "(--no-adaptive-prefetch: always --side-slots)",
    ),
    Flag("--ahead-lo", "ahead_lo", int, "prefetch distance (MoE layers) before --cutoff"),
    Flag("--ahead-hi", "ahead_hi", int, "prefetch distance (MoE layers) from --cutoff on"),
    Flag("--cutoff", "cutoff", int, "first MoE layer that uses --ahead-hi"),
    Flag("--lfu", "side_lfu", None, "persistent LFU side region (--no-lfu: double buffer)"),
    Flag(
        "--sync", "sync", None, "fill the side region synchronously (diagnostic; needs --prefetch)"
    ),
    Flag("--policy", "policy", str, "real-region eviction", choices=EVICTION_POLICIES),
    Flag("--autopin-frac", "autopin_frac", float, "fraction of the expert slots autopin pins"),
    Flag(
        "--scratch-slots",
        "scratch_slots",
        int,
        "experts per chunk of a call with more misses than evictable slots (unused on "
        "MLX CUDA, where such a call uses the layer scratch)",
        deprecated=("--prefill-chunk",),
    ),
    Flag("--reader-threads", "reader_threads", int, "background reader threads"),
    Flag(
        "--device-acquire",
        "device_acquire",
        None,
        "on MLX CUDA, a decode step's acquire is a kernel on the GPU's stream answered "
        "through mapped memory (--no-device-acquire: on the CPU stream, as other backends)",
    ),
    Flag(
        "--fill-stream",
        "fill_stream",
        None,
        "with the device acquire, prefetch fills are copied by the GPU's copy engines on a "
        "stream of their own beside the compute (experimental: on an H200, serving 1 and 4 "
        "clients with it gave no figure in seven minutes, docs/benchmarks.md; default off, "
        "the fills go with the next layer's copies on the compute stream)",
    ),
    Flag(
        "--io-uring",
        "io_uring",
        None,
        "demand reads through io_uring where the kernel has it (--no-io-uring: the reader threads)",
    ),
)

# The two ways to size the real regions: each field's other.
_SIZES = {"expert_slots": "expert_memory", "expert_memory": "expert_slots"}

# How a default of None reads in --help.
_NONE_MEANS = {
    "expert_slots": "all experts",
    "expert_memory": "not given: --expert-slots sizes them",
    "cutoff": "half the MoE layers",
    "scratch_slots": "top-k; 1 on MLX CUDA",
    "reader_threads": "min(8, 2 x CPUs), at least top-k - 1",
}


def default_text(field: str) -> str:
    """StreamConfig's default of `field` as --help shows it."""
    value = StreamConfig.__dataclass_fields__[field].default
    if value is None:
        return _NONE_MEANS[field]
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


class _Deprecated(argparse.Action):
    """A renamed flag: stores like the new one, and says so on stderr."""

    def __init__(self, option_strings, dest, new_name: str, **kw):
        self.new_name = new_name
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: warning: {option_string} is deprecated, use {self.new_name}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_cache_flags(
    parser: argparse.ArgumentParser, defaults: Mapping[str, str] | None = None
) -> argparse._ArgumentGroup:
    """Adds the cache flags as one group of `parser`. Each flag defaults to None (not
    given); its help shows the default it then takes: StreamConfig's, or
    `defaults[field]` (text) where a front end fills the field itself."""
    defaults = defaults or {}
    g = parser.add_argument_group(
        "expert cache (flags win over the environment variables "
        + ", ".join(f"{var} ({field})" for var, field in ENV_FIELDS.items())
        + ")"
    )
    for f in FLAGS:
        text = f"{f.help} (default: {defaults.get(f.field) or default_text(f.field)})"
        if f.kind is None:
            g.add_argument(f.name, dest=f.field, action=argparse.BooleanOptionalAction, help=text)
            continue
        g.add_argument(f.name, dest=f.field, type=f.kind, choices=f.choices or None, help=text)
        for old in f.deprecated:
            g.add_argument(
                old,
                dest=f.field,
                type=f.kind,
                action=_Deprecated,
                new_name=f.name,
                help=argparse.SUPPRESS,
            )
    return g


def _parse(field: str, text: str):
    kind = {f.name: f.type for f in dataclasses.fields(StreamConfig)}[field]
    if "bool" in str(kind):
        if text.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if text.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected 0 or 1")
    number = float if "float" in str(kind) else int
    try:
        return number(text)
    except ValueError:
        raise ValueError(f"expected {'a number' if number is float else 'an integer'}") from None


def config_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The StreamConfig fields set by environment variables (`ENV_FIELDS`).

    Returns:
        {field: value} for each variable of `ENV_FIELDS` present in `environ`
        (default `os.environ`).

    Raises:
        ValueError: a variable's value does not parse; the message names the variable.
    """
    environ = os.environ if environ is None else environ
    out = {}
    for var, field in ENV_FIELDS.items():
        if var in environ:
            try:
                out[field] = _parse(field, environ[var])
            except ValueError as e:
                raise ValueError(f"environment variable {var}={environ[var]!r}: {e}") from None
    return out


_PREFETCH_WITHOUT_SIDE_SLOTS = (
    "--prefetch needs side-region slots to fill: add --side-slots N (N >= 1)"
)
_SIDE_SLOTS_WITHOUT_PREFETCH = (
    "--side-slots {n} with --no-prefetch: only prefetch fills side rows, and this command "
    "cannot turn it on later (the app's Prefetch box can); give --side-slots 0, or leave "
    "out --no-prefetch"
)
_SYNC_WITHOUT_PREFETCH = (
    "--sync makes prefetch fills synchronous, and prefetch is off here: leave out --sync, "
    "or turn prefetch on with --side-slots N (N >= 1)"
)


def config_overrides(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict:
    """The StreamConfig fields the user set: the environment's, then the flags given
    (`add_cache_flags`); side_slots given sets prefetch (on for > 0, off for 0) unless
    prefetch was set too (the app's default is on), and
    --expert-memory / --expert-slots override the other's environment variable.

    Raises:
        ValueError: an environment variable does not parse (named in the message),
            --prefetch is given with --side-slots 0, or --sync with prefetch turned off
            (--no-prefetch, --side-slots 0).
    """
    values = config_from_env(environ)
    flags = {f.field for f in FLAGS if getattr(args, f.field, None) is not None}
    for field in flags:
        values[field] = getattr(args, field)
        # --expert-memory and --expert-slots size the same thing: a flag beats the other
        # one's environment variable (both flags given stay, for StreamConfig to refuse).
        if field in _SIZES and _SIZES[field] not in flags:
            values.pop(_SIZES[field], None)
    if "side_slots" in values and "prefetch" not in values:
        values["prefetch"] = values["side_slots"] > 0
    _refuse_idle_prefetch(values, args)
    return values


def _refuse_idle_prefetch(values: Mapping, args: argparse.Namespace) -> None:
    """Refuses prefetch with no side rows to fill, and --sync with prefetch off: each would
    do nothing. A field absent from `values` is not known yet (a front end's default fills
    it) and refuses nothing; SIDEREGION_SYNC alone is a preference for when prefetch is on,
    and refuses nothing either."""
    if values.get("prefetch") and values.get("side_slots") == 0:
        raise ValueError(_PREFETCH_WITHOUT_SIDE_SLOTS)
    if getattr(args, "sync", None) is True and values.get("prefetch") is False:
        raise ValueError(_SYNC_WITHOUT_PREFETCH)


def with_defaults(defaults: Mapping, given: Mapping) -> dict:
    """StreamConfig fields `given` over `defaults`, less a default that sizes the real
    regions the other way than `given` does (--expert-memory given: no default
    expert_slots, and the reverse)."""
    kept = {k: v for k, v in defaults.items() if given.get(_SIZES.get(k)) is None}
    return {**kept, **given}


def stream_config(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping | None = None,
) -> StreamConfig:
    """StreamConfig of `defaults` (fields; StreamConfig's own for the rest) overridden
    by `config_overrides(args, environ)`.

    The command-line front ends' config: unlike the app (`config_overrides`), they have
    no live prefetch toggle, so side rows with prefetch turned off are refused.

    Raises:
        ValueError: an environment variable does not parse, --prefetch is on without side
            slots, --side-slots N > 0 with --no-prefetch, --sync is given with prefetch
            off, or a value is out of range; the message names the flag or variable.
    """
    if getattr(args, "prefetch", None) is False and (getattr(args, "side_slots", None) or 0) > 0:
        raise ValueError(_SIDE_SLOTS_WITHOUT_PREFETCH.format(n=args.side_slots))
    values = with_defaults(defaults or {}, config_overrides(args, environ))
    known = {f: StreamConfig.__dataclass_fields__[f].default for f in ("prefetch", "side_slots")}
    _refuse_idle_prefetch(known | values, args)  # now with every default known
    try:
        return StreamConfig(**values)
    except ConfigError as e:
        raise ValueError(config_error_message(e, args, environ)) from None


def flag_names() -> dict[str, str]:
    """{StreamConfig field: its flag}, e.g. {"expert_slots": "--expert-slots"}."""
    return {f.field: f.name for f in FLAGS}


def describe(e: ConfigError, names: Mapping[str, str]) -> str:
    """`e` in a front end's words: each field by `names[field]` (the field itself when
    absent), its value as the user gave it ("50MiB")."""
    name = names.get(e.field, e.field)
    if e.also:
        return f"{name} and {names.get(e.also, e.also)} are both given: {e.what}"
    return f"{name} {e.value}: {e.what}"


def config_error_message(
    e: ConfigError, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> str:
    """`e` naming what set the field: the environment variable (`ENV_FIELDS`, its text as
    set) when it did and the flag was not given, else the flag."""
    environ = os.environ if environ is None else environ
    var = next((v for v, f in ENV_FIELDS.items() if f == e.field and v in environ), None)
    if var is not None and not e.also and getattr(args, e.field, None) is None:
        return f"environment variable {var}={environ[var]}: {e.what}"
    return describe(e, flag_names())
