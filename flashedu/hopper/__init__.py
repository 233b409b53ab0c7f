"""FlashAttention-3's ideas on Hopper (sm_90), chapter 11. Importing the package imports nothing;
each module loads by name:

* `model`: the exponential budget and the producer/consumer timeline, as models on a CPU.
* `fp8`: FP8 attention emulated on a CPU (block scales, Hadamard rotation, error against float64).
* `triton_fwd` / `triton_bwd`: the Triton Hopper forward (TMA tensor descriptors, FP8) and the
  one-pass backward. `gluon_fwd`: the forward in Gluon, FA3's overlap written out (GPU only).
* `dispatch`: the registry's "hopper" entry, the Hopper kernels where they run, the FA2 ones
  elsewhere. `results`: the H200 measurements, read from notebooks/results/h200_hopper.json.
"""
