"""Argument types of the ``openk3`` commands: each parses one flag's text and, for a value out of range, raises
``argparse.ArgumentTypeError``, which argparse prints as one line naming the flag, what was expected and the
text given (``argument --lr: expected a finite number > 0, got 'nan'``)."""

from __future__ import annotations

import argparse
import math


def checked(cast, what: str, ok):
    """An argparse type: ``cast(text)`` for which ``ok(value)`` holds; otherwise the error above, with
    ``what`` as the expectation."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = checked(int, "an int >= 1", lambda v: v >= 1)
non_negative_int = checked(int, "an int >= 0", lambda v: v >= 0)
steps = checked(int, "an int in [1, 10^9]", lambda v: 1 <= v <= 10**9)  # 10^9 steps: past any real run
seed = checked(int, "an int in [0, 2^63)", lambda v: 0 <= v < 2**63)
positive_float = checked(float, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)
temperature = checked(float, "a finite number >= 0 (0 = greedy)", lambda v: math.isfinite(v) and v >= 0)
top_p = checked(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
