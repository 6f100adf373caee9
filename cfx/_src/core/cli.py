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

import sys
from typing import Any, Callable, Sequence


def run_command(parse_args: Callable[[Sequence[str] | None], Any], run: Callable[[Any], Any],
                argv: Sequence[str] | None, *, report: Callable[[Any, Any], None] | None = None) -> int:
    """``run(parse_args(argv))``, then ``report(args, result)``; 0. A ValueError (the user's mistake,
    with its fix) is printed as ``error: ...`` on stderr instead; 2."""
    args = parse_args(argv)
    try:
        result = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report is not None:
        report(args, result)
    return 0
