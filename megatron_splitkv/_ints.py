"""One check for every integer argument of the package (block sizes, head counts, chunk counts, CP sizes
and ranks, ...): `as_int`.

Policy: an integer is anything with `__index__` (`operator.index`): Python ints, numpy integer scalars
(np.int64(16), np.uint8(8)), 0-d integer torch tensors, and user types that implement `__index__`.
Booleans (bool, np.bool_, bool tensors) and floats are rejected: True is not a head count, and 16.0
usually means a computation went through float. The planner alone keeps accepting integral floats
(`integral_float=True`), a documented behaviour of `plan_context_parallel` since its first release.

Text (environment variables, a tool's `name=value` options): `parse_int`, the one strict parser: a plain
ASCII decimal integer ("64", "-1") of at most `MAX_DIGITS` significant digits, nothing else ("+64", "64.0",
"1e2", "1_000", "0x40", non-ASCII digits);
`int_arg`, the argparse `type=` of the package's own integer
flags (argparse's `type=int` takes "+64" and "1_000").

Real numbers as text (a tool's or the demo's float flags, float environment variables): `parse_float` and, for
argparse, `float_arg`: a plain ASCII decimal number ("0.5", "-2", "1e-3", ".5"), finite, within its limits;
not "nan", "inf", "1e999" (inf after rounding), "1_0", "0x1p3" or non-ASCII digits (`float()` takes most of
them, and a NaN bandwidth or learning rate then only shows as NaN results).

Pure Python (no torch / numpy import) so that argument parsing can use it.
"""

import argparse
import math
import operator
import os
import re
import tempfile

__all__ = ["as_int", "parse_int", "is_int_text", "parse_float", "float_arg", "int_arg",
           "DefaultsHelpFormatter", "existing_path", "existing_dir", "hf_model_dir"]

_DECIMAL = re.compile(r"-?[0-9]+")  # ASCII only: int() would also take "+64", "1_000" and non-ASCII digits
# a plain decimal real number: float() would also take "nan", "inf", "1_0" and non-ASCII digits
_REAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")

#: `parse_int` takes at most this many significant digits (Python's default int-conversion limit, fixed here
#: whatever `sys.set_int_max_str_digits` says): a longer number is refused with the package's message, naming
#: the variable and the allowed range, not Python's own ValueError
MAX_DIGITS = 4300
_SHOWN = 40  # characters of a long text quoted in a message


def _shown(text) -> str:
    """repr(text), cut to its first characters (and its length) when it is long; an int too long for
    repr() (Python's int-conversion limit) as its digit count."""
    if isinstance(text, str) and len(text) > _SHOWN:
        return f"{text[:_SHOWN]!r}... ({len(text)} characters)"
    try:
        return repr(text)
    except ValueError:  # int.__repr__ beyond sys.get_int_max_str_digits()
        n = operator.index(text) if hasattr(text, "__index__") else None
        if n is None:
            raise
        return f"an int of about {int(abs(n).bit_length() * 0.30103) + 1} digits"


def _is_bool(value) -> bool:
    if isinstance(value, bool):
        return True
    # np.bool_ / torch.bool scalars and 0-d tensors, without importing numpy or torch
    dtype = getattr(value, "dtype", None)
    return type(value).__name__ in ("bool_", "bool") or (dtype is not None and "bool" in str(dtype))


def _limit(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def as_int(value, name: str, *, minimum=None, maximum=None, what: str | None = None,
           integral_float: bool = False, allow_none: bool = False, error=ValueError):
    """`value` as a Python int, checked.

    Args:
        value: the argument. Accepted: anything with `__index__` (int, numpy integer scalars, 0-d integer
            torch tensors, ...), and with `integral_float=True` also real numbers with an integral value
            (2.0, np.float32(2)). Rejected: bool and boolean scalars, floats (unless integral_float),
            arrays / tensors with a dimension (even of one element), strings, None (unless allow_none), values outside [minimum, maximum].
        name: the argument's name as the user wrote it (e.g. "block_size", "--dflash-data-workers"); the
            error message starts with it.
        minimum, maximum: inclusive limits (None: unbounded).
        what: the requirement as the message states it (default: derived from the limits, e.g.
            "a positive int" for minimum 1; "an int in [0, 4)" is the caller's to write).
        integral_float: accept integral real numbers (the planner's historical behaviour).
        allow_none: return None for None (the message then says "None or ...").
        error: the exception class raised (default ValueError; e.g. the Megatron flags'
            SplitKVArgumentError, a ValueError subclass).

    Returns:
        int (or None when allow_none and value is None).

    Raises:
        `error` (ValueError by default): "<name> must be <what>, got <value!r>" for a wrong type or a
            value outside the limits.
    """
    if value is None and allow_none:
        return None
    req = what if what is not None else _limit(minimum, maximum)
    if allow_none and what is None:
        req = "None or " + req
    out = None
    if not _is_bool(value) and not getattr(value, "ndim", 0):  # scalars only: no 1-element tensors
        try:
            out = operator.index(value)
        except TypeError:
            if integral_float:
                try:
                    f = float(value)
                    # only real numbers: strings / tensors with more than one element are not coerced
                    if f.is_integer() and not isinstance(value, (str, bytes)) and hasattr(value, "__float__"):
                        out = int(f)
                except (TypeError, ValueError, OverflowError):
                    out = None
    if out is None or (minimum is not None and out < minimum) or (maximum is not None and out > maximum):
        raise error(f"{name} must be {req}, got {_shown(value)}")
    return out


def is_int_text(text) -> bool:
    """Whether `text` (a str; surrounding whitespace ignored) is what `parse_int` accepts as an integer: a
    plain ASCII decimal integer with an optional minus sign ("64", "-1"; not "+64", "64.0", "1_000")."""
    return isinstance(text, str) and _DECIMAL.fullmatch(text.strip()) is not None


def parse_int(text, name: str, *, minimum=None, maximum=None, what: str | None = None, error=ValueError) -> int:
    """`text` (a str: an environment variable's value, a tool option's `value`) as an int, checked.

    Accepted: a plain ASCII decimal integer, surrounding whitespace ignored ("64", " 64 ", "-1"). Rejected:
    everything else ("+64", "64.0", "1e2", "1_000", "0x40", "", non-ASCII digits), values outside
    [minimum, maximum], and numbers of more than `MAX_DIGITS` significant digits (whatever the limits).

    Args:
        name: the variable / option as the user wrote it; the message starts with it.
        minimum, maximum, what, error: as in `as_int`.

    Raises:
        `error` (ValueError by default): "<name> must be <what>, got <text!r>" (the text as given; a long
            text cut to its first characters and its length).
    """
    req = what if what is not None else _limit(minimum, maximum)
    if not is_int_text(text):
        raise error(f"{name} must be {req} (decimal digits), got {_shown(text)}")
    body = text.strip()
    sign = "-" if body.startswith("-") else ""
    digits = body.lstrip("-").lstrip("0") or "0"  # leading zeros count against int()'s limit, not the value's
    if len(digits) > MAX_DIGITS:
        raise error(f"{name} must be {req} (at most {MAX_DIGITS} digits), got a {len(digits)}-digit number "
                    f"{_shown(text)}")
    value = int(sign + digits)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise error(f"{name} must be {req}, got {_shown(text)}")
    return value


def _real_limit(minimum, maximum, above) -> str:
    lo = None if minimum is None else (f"> {minimum:g}" if above else f">= {minimum:g}")
    if lo is not None and maximum is not None:
        return f"a finite number {lo} and <= {maximum:g}"
    if lo is not None:
        return f"a finite number {lo}"
    if maximum is not None:
        return f"a finite number <= {maximum:g}"
    return "a finite number"


def parse_float(text, name: str, *, minimum=None, maximum=None, above: bool = False, what: str | None = None,
                error=ValueError) -> float:
    """`text` (a str: a flag's or an environment variable's value) as a finite float, checked.

    Accepted: a plain ASCII decimal number, surrounding whitespace ignored ("0.5", " 2 ", "-1", "1e-3", ".5",
    "+3"), finite after conversion, >= minimum (> minimum with above=True) and <= maximum when given.
    Rejected: "nan", "inf", "infinity", numbers that overflow to inf ("1e999"), "1_000", hex floats,
    non-ASCII digits, "", values outside the limits.

    Raises:
        `error` (ValueError by default): "<name> must be <what>, got <text!r>" (default what: "a finite
            number >= minimum" and so on).
    """
    req = what if what is not None else _real_limit(minimum, maximum, above)
    value = None
    if isinstance(text, str) and _REAL.fullmatch(text.strip()) is not None:
        try:
            value = float(text)
        except (ValueError, OverflowError):
            value = None
    if value is None or not math.isfinite(value):
        raise error(f"{name} must be {req}, got {_shown(text)}")
    if minimum is not None and (value <= minimum if above else value < minimum):
        raise error(f"{name} must be {req}, got {_shown(text)}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be {req}, got {_shown(text)}")
    return value


def _arg_type(parse_text, type_name: str, **checks):
    """An argparse `type=` calling `parse_text(text, "value", **checks)`: its ValueError becomes argparse's one
    error line naming the flag ("argument --lr: must be ..., got 'nan'"), exit status 2."""
    def parse(text):
        try:
            return parse_text(text, "value", **checks)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    parse.__name__ = type_name  # argparse's fallback message names the type by it
    return parse


def float_arg(minimum=None, maximum=None, *, above: bool = False, what: str | None = None):
    """An argparse `type=` for a finite real flag (`parse_float`'s rules and limits): a bad value is argparse's
    one error line naming the flag ("argument --lr: must be a finite number >= 0, got 'nan'"), exit status 2."""
    return _arg_type(parse_float, "finite number", minimum=minimum, maximum=maximum, above=above, what=what)


def int_arg(minimum=None, maximum=None, *, what: str | None = None):
    """An argparse `type=` for an integer flag (`parse_int`'s rules and limits; argparse's `type=int` also takes
    "+64" and "1_000"): a bad value is argparse's one error line naming the flag ("argument --cp-chunk-size:
    must be an int (decimal digits), got '+64'"), exit status 2."""
    return _arg_type(parse_int, "int", minimum=minimum, maximum=maximum, what=what)



class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The `formatter_class` of the package's command lines: argparse's ArgumentDefaultsHelpFormatter ("(default:
    X)" after each flag's help), except where the help text already states its default (contains "default")."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default" in text.lower() else super()._get_help_string(action)


def existing_path(text: str) -> str:
    """An argparse `type=` for a flag naming a file or directory that must exist: otherwise argparse's one error
    line naming the flag ("argument --target-load: no such file or directory: '/x'"), exit status 2."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r}")
    return text


def existing_dir(text: str) -> str:
    """An argparse `type=` for a flag naming a directory that must exist (argparse's error line otherwise)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return text


def writable_dir(text: str) -> str:
    """An argparse `type=` for a flag naming a directory to write: created now if missing (as the run would at
    its first save); argparse's error line naming the flag when that fails or the path is not a directory in
    which a directory can be made (`_write_probe`; e.g. a file, /proc, a read-only mount)."""
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create directory {text!r}: {exc.strerror or exc}")
    why = _write_probe(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"cannot write in {text!r} ({why})")
    return text


def _write_probe(directory: str):
    """None when a new entry can be made in the existing directory `directory` (write and search permission,
    then a temporary subdirectory created and removed: the test that holds for root, for which os.access says
    yes everywhere, on a read-only mount and on a pseudo file system such as /proc); else the reason, a short
    text."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return "permission denied"
    try:
        probe = tempfile.mkdtemp(prefix=".write-check-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.rmdir(probe)
    return None


def output_dir(text: str) -> str:
    """An argparse `type=` for a directory a command writes into later (its results at the end of a run): an
    existing directory, or a new path whose nearest existing parent is a directory, in which a directory can be
    made now (`_write_probe`: a temporary subdirectory made and removed). Nothing is left behind; the command
    creates the directory when it writes. argparse's error line naming the flag otherwise (an empty path, an
    existing file, a path under a file, a parent without write permission, a read-only or pseudo file system
    such as /proc; a dangling symbolic link or a link loop on the path, where no directory can be made), before
    the run starts."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path is not a directory")
    path = os.path.abspath(text)
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.exists(parent):  # a link whose target is missing (or a loop): makedirs would fail there
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is a symbolic link to nothing (a missing target or "
                                         "a loop), not a directory")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is an existing file, not a directory")
    why = _write_probe(parent)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot create a directory in {parent} ({why})")
    return text


def hf_model_dir(text: str) -> str:
    """An argparse `type=` for a flag naming a Hugging Face model directory: one holding a config.json."""
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text}: no config.json (a Hugging Face model directory is needed)")
    return text
