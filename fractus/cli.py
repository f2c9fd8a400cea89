"""argparse types the command-line tools share: bounded finite numbers and a usable device."""
from __future__ import annotations

import argparse
import math

import torch


def number(kind: type, test, what: str):
    """An argparse type: a ``kind`` that passes ``test`` (``what`` says how), finite if a float."""
    def parse(text: str):
        x = kind(text)
        if not (math.isfinite(x) and test(x)):
            raise argparse.ArgumentTypeError(f"must be {'finite and ' * (kind is float)}{what}, got {text}")
        return x
    parse.__name__ = kind.__name__  # argparse's "invalid int value"
    return parse


positive_int = number(int, lambda n: n >= 1, "≥ 1")
natural = number(int, lambda n: n >= 0, "≥ 0")
non_negative = number(float, lambda x: x >= 0, "≥ 0")


def device_name(text: str) -> str:
    """An argparse type: a device this torch can use (kept as its name)."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda, cuda:N)") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise argparse.ArgumentTypeError(f"{text!r} is not available here (this torch sees "
                                         f"{torch.cuda.device_count()} CUDA device(s))")
    return text
