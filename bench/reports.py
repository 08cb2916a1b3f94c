"""File names of the benchmark reports: `<date>-<topic>-<device>` (then .md, .json, .png), e.g.
`2026-11-28-groupnorm-fwd-h200.md`. The date is today's (UTC), the device the GPU's name in
lower case with every run of other characters a dash and the vendor dropped ("NVIDIA H100 80GB
HBM3" -> "h100-80gb-hbm3"). Used by the bench/*.py scripts that write reports."""
from __future__ import annotations

import datetime as _dt
import re

_VENDORS = ("nvidia-", "amd-")


def device_slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    for vendor in _VENDORS:
        if slug.startswith(vendor) and len(slug) > len(vendor):
            slug = slug[len(vendor):]
    return slug or "gpu"


def report_stem(topic: str, device: str, date: str | None = None) -> str:
    """`<date>-<topic>-<device slug>`; `date` defaults to today (UTC, YYYY-MM-DD)."""
    day = date or _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    return f"{day}-{topic}-{device_slug(device)}"
