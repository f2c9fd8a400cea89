"""Hot ops of the model, one package per op (``fractus/ops/<op>/``).

An op with Triton kernels (``linear_attention``, ``moe``, ``cross_entropy``, ``kuramoto``) holds:

- ``reference.py``: the plain fp32 reference (``<op>_reference``), and the argument checks that
  every path shares;
- ``pytorch.py``: the fast PyTorch path for CPU (``<op>_torch``), plain autograd or an autograd
  Function with a hand-written backward (the Kuramoto clock's: the reverse RK4 steps);
- ``kernels.py``: the Triton kernels with their autograd Function (``<op>_triton``);
- ``__init__.py``: the one public function, which dispatches between them through
  :func:`fractus.ops.common.pick` (Triton on CUDA, PyTorch on CPU, Triton's interpreter when asked),
  and re-exports the paths' entry points.

An op without kernels is one module (``delta_rule``). Beside the ops: :mod:`.common` (the backend
choice, the kernels' output buffers and autograd guard, the decays per level the recurrences
share) and :mod:`.interpreter` (Triton's interpreter made to round as a GPU does, installed when a
kernel runs on CPU tensors). Nothing here imports the model, the benchmarks or the checks of
:mod:`fractus.verify`, which sit above the ops.
"""
