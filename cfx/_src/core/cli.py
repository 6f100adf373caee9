"""What every command line shares (``python -m cfx.train``, ``cfx.generate``, ``cfx.diffusion.train``,
``cfx.diffusion.dreambooth``, ``cfx.diffusion.sample``).

Each command's implementation is a ``cli_*.py`` module with ``parse_args(argv)`` (argparse, ``prog=
"python -m cfx.NAME"``; a malformed flag exits through ``parser.error``, status 2), ``run(args)``
(the work, with a progress bar where it is long; the user's mistakes found on the way are
ValueErrors naming the flag and the fix) and ``main(argv=None) -> int``, which is ``run_command``;
the public module re-exports them and runs ``sys.exit(main())`` under ``python -m``. Their ``--mesh``
is read by ``cfx._src.plan.config.parse_mesh``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Sequence


REFUSAL_GRACE_S = 2.0  # how long a refusing rank under torchrun waits before it exits (run_command)


def run_command(parse_args: Callable[[Sequence[str] | None], Any], run: Callable[[Any], Any],
                argv: Sequence[str] | None, *, report: Callable[[Any, Any], None] | None = None) -> int:
    """``run(parse_args(argv))``, then ``report(args, result)``; 0. A ValueError (the user's mistake,
    with its fix) is printed as ``error: ...`` on stderr instead; 2."""
    args = parse_args(argv)
    try:
        result = run(args)
    except ValueError as e:
        # one write of the whole line: under torchrun every rank refuses at once into one unbuffered pipe,
        # where print's separate write of the newline let two ranks' lines run together
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun, which stops every rank once one exits:
            time.sleep(REFUSAL_GRACE_S)                   # the others refuse in this time too, each in its line
        return 2
    if report is not None:
        report(args, result)
    return 0


class _ShowDefaults(argparse.HelpFormatter):
    """``(default: X)`` after an option's help, unless it has none to show or already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and _shown(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text.strip()


def _shown(action: argparse.Action) -> bool:
    """An option's default worth a word: a value (not a switch's True/False, not None)."""
    return action.nargs != 0 and action.default is not None and action.default != argparse.SUPPRESS


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of a command: ``--help`` shows every option's default (``parse`` finishes it)."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=_ShowDefaults)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, every option with a line in ``--help`` (its default, if nothing else)."""
    for action in parser._actions:
        if action.help is None and action.option_strings and _shown(action):
            action.help = "default: %(default)s"
    return parser.parse_args(argv)
