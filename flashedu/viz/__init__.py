"""matplotlib figures the chapters draw, as pure functions: one namespace, `viz.X`.

* `explorer`: the numbers behind the traffic widgets (`explorer_state`, `roofline_points`,
  `stepper_frames`, ...); `draw`: their drawings (`draw_traffic`, `draw_roofline`, `draw_tiles`).
* `figures`: block maps of a mask, the measured TFLOP/s panels, the CPU benchmark table.
* `flashedu.traffic.replay` (re-exported here): a measured kernel run drawn program by program.

Introduced in notebooks/00_memory_hierarchy.ipynb.
"""

from __future__ import annotations

from ..traffic.replay import draw_measured, draw_program, measured_state, program_frames
from .draw import (
    FLASH,
    STANDARD,
    byte_unit,
    describe,
    draw_roofline,
    draw_tiles,
    draw_traffic,
    fmt_time,
    png,
)
from .explorer import (
    ALGORITHMS,
    ITEMSIZE,
    TILE_RULES,
    default_tiles,
    explorer_state,
    roofline_points,
    stepper_frames,
)
from .figures import KIND_CODE, KIND_COLORS, cpu_table, show_block_map, tflops_panels

__all__ = [
    "ALGORITHMS",
    "FLASH",
    "ITEMSIZE",
    "KIND_CODE",
    "KIND_COLORS",
    "STANDARD",
    "TILE_RULES",
    "byte_unit",
    "cpu_table",
    "default_tiles",
    "describe",
    "draw_measured",
    "draw_program",
    "draw_roofline",
    "draw_tiles",
    "draw_traffic",
    "explorer_state",
    "fmt_time",
    "measured_state",
    "png",
    "program_frames",
    "roofline_points",
    "show_block_map",
    "stepper_frames",
    "tflops_panels",
]
