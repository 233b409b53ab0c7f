"""How many bytes move between HBM and SRAM, and how long that must take: the traffic model.

One namespace for the chapters (`traffic.flash_forward`, `traffic.GPUS`, `traffic.measure`, ...),
defined in:

* `closed_forms`: bytes of standard attention and of FlashAttention's forward and backward, in O(1)
  or O(query blocks), held equal byte for byte to the instrumented code and the measured kernels.
* `ledger`: the `Ledger` the instrumented algorithms (`naive`, `tiled`) report each transfer to,
  and the `Traffic` totals every count returns.
* `hardware`: GPU presets (data, each with its source), FLOPs and exponentials of the visible mask
  area, and the roofline.
* `tiles`: tile sizes from an SRAM budget (the paper's rule, and the powers of two that fit).
* `measured`: `measure()`, the bytes a Triton kernel really moves under the interpreter.
* `paged`: `paged_decode_bytes`, what paged split-KV decoding moves (chapter 12).
* `kernel_bytes` and `replay` (imported by name, not here): a kernel's measured bytes beside the
  closed form, and measured runs replayed for the widgets.

Introduced in notebooks/00_memory_hierarchy.ipynb; the tiled counts in
notebooks/03_tiled_forward.ipynb; the measured bytes in notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

from .closed_forms import (
    BACKWARD_VARIANTS,
    DEFAULT_SRAM_BYTES,
    flash_backward,
    flash_forward,
    naive_backward,
    naive_forward,
    paper_gpt2_medium,
    saved_for_backward,
    triton_forward_extra,
)
from .hardware import (
    GPU,
    GPUS,
    PASSES,
    SFU_H100,
    Roofline,
    attention_flops,
    benchmark_flops,
    exp_count,
    exp_time,
    gpu_preset,
    roofline,
)
from .ledger import (
    NULL_LEDGER,
    Difference,
    Ledger,
    NullLedger,
    SramCapacityError,
    Traffic,
    Transfer,
    combine,
    compare,
    tensor_order,
)
from .measured import MeasureError, Measurement, measure
from .paged import paged_decode_bytes, paged_split
from .tiles import TileChoice, block_sizes, fitting_blocks, sram_tiles, tile_bytes, tile_choice

__all__ = [
    "BACKWARD_VARIANTS",
    "DEFAULT_SRAM_BYTES",
    "GPU",
    "GPUS",
    "NULL_LEDGER",
    "PASSES",
    "SFU_H100",
    "Difference",
    "Ledger",
    "MeasureError",
    "Measurement",
    "NullLedger",
    "Roofline",
    "SramCapacityError",
    "TileChoice",
    "Traffic",
    "Transfer",
    "attention_flops",
    "benchmark_flops",
    "block_sizes",
    "combine",
    "compare",
    "exp_count",
    "exp_time",
    "fitting_blocks",
    "flash_backward",
    "flash_forward",
    "gpu_preset",
    "measure",
    "naive_backward",
    "naive_forward",
    "paged_decode_bytes",
    "paged_split",
    "paper_gpt2_medium",
    "roofline",
    "saved_for_backward",
    "sram_tiles",
    "tensor_order",
    "tile_bytes",
    "tile_choice",
    "triton_forward_extra",
]
