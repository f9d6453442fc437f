"""The installed distribution's version: ``pyproject.toml``'s, the one place it is written.

Read from the package metadata, so that a caller below the package face (``preflight``) has it without
importing the face, and nothing here imports torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("lightning-zero")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    VERSION = "0+unknown"
