"""``lightning-zero report RUN_DIR``: a step profile (``step_profile.json``, written by
``ZeroStrategy(profile_steps=(first, last))``) as a Markdown page with PNG charts and a three-line
summary that names the one thing to look at first. Reads JSON, writes files: no torch, no Lightning;
matplotlib is imported when the charts are drawn.

  * :mod:`~lightning_zero.report.profile`: finding and reading the profile, its figures;
  * :mod:`~lightning_zero.report.rules`: the summary and the rule table (``docs/report.md``);
  * :mod:`~lightning_zero.report.charts`: the PNGs;
  * :mod:`~lightning_zero.report.page`: the Markdown page, and :func:`write_report`.
"""

from __future__ import annotations

from lightning_zero.report.page import Report, write_report
from lightning_zero.report.profile import PROFILE_FILE, Profile, ReportError, find_profile, load_profile
from lightning_zero.report.rules import RULES, Rule, summary

__all__ = [
    "PROFILE_FILE",
    "RULES",
    "Profile",
    "Report",
    "ReportError",
    "Rule",
    "find_profile",
    "load_profile",
    "summary",
    "write_report",
]
