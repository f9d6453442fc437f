"""The argument style of the commands that read a checkpoint (`recipes.generate`, `recipes.evaluate`).

`key=value` like the Hydra overrides of `recipes.pretrain`, or `--key value` like any command: both
reach argparse as `--key=value` (`hydra_style`), so the two spellings cannot disagree.
"""

from __future__ import annotations

import re


def hydra_style(argv: list[str]) -> list[str]:
    """Turn `key=value` arguments into `--key=value` for argparse (`max_new_tokens` -> `--max-new-tokens`)."""
    converted = []
    for arg in argv:
        match = re.fullmatch(r"([a-z_]+)=(.*)", arg, flags=re.DOTALL)
        converted.append(f"--{match.group(1).replace('_', '-')}={match.group(2)}" if match else arg)
    return converted
