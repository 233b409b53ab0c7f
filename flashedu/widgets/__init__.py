"""Interactive views of HBM/SRAM traffic (ipywidgets), thin front-ends over `flashedu.viz`.

* `explorer`: `traffic_explorer` (sliders for N, d, dtype, tiles, SRAM, GPU preset, algorithm),
  `roofline_plot`. `stepper`: `tile_stepper` (the ledger `tiled.forward` fills, tile by tile).
* `measured`: `measured_explorer`, a Triton kernel's measured bytes beside the closed form.

Every number a widget shows comes from a pure function the tests check without a browser.
Introduced in notebooks/00_memory_hierarchy.ipynb.
"""

from __future__ import annotations

from .explorer import (
    RooflinePlot,
    TrafficExplorer,
    explorer_details_html,
    explorer_html,
    roofline_plot,
    traffic_explorer,
)
from .measured import MeasuredExplorer, measured_explorer
from .stepper import TileStepper, measured_step_html, stepper_html, tile_stepper

__all__ = [
    "MeasuredExplorer",
    "RooflinePlot",
    "TileStepper",
    "TrafficExplorer",
    "explorer_details_html",
    "explorer_html",
    "measured_explorer",
    "measured_step_html",
    "roofline_plot",
    "stepper_html",
    "tile_stepper",
    "traffic_explorer",
]
