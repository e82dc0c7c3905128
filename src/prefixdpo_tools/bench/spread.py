"""Median and range of repeated measurements, as every bench report states them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Spread:
    """Median and range of repeated measurements."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        return cls(float(statistics.median(values)), float(min(values)), float(max(values)))
