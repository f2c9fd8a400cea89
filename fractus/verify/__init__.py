"""The checks that stand in for a GPU when none is present, and the one that checks on the GPU what
they cannot.

- :mod:`.interpret`: Triton's interpreter as these checks use it: rounding bf16 and tf32 as a GPU
  does (:func:`.interpret.install`, :mod:`fractus.ops.interpreter`'s, which the ops install
  themselves when a kernel runs on CPU tensors), so that the kernels' tests on CPU meet a GPU's
  rounding; and :func:`.interpret.address_check`, which runs each launch's last programs and raises
  on int32 offset arithmetic a GPU would wrap past 2³¹.
- :mod:`.aot`: every kernel compiled ahead of time for sm_90 (H100/H200) with Triton's own
  compiler and ``ptxas``, no GPU needed (``python -m fractus.bench aot``: registers, spills,
  shared memory); the GPU suite reuses its captures to precompile what it launches.
- :mod:`.offsets`: the kernels run once on the device at offsets past 2³¹ elements (the GPU
  suite's last stage), what the compiler made of the offsets that ``address_check`` checks.
"""
