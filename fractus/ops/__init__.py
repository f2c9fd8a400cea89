"""Hot ops of the model, one module per op.

Each module holds a plain fp32 reference, a fast PyTorch path for CPU, the Triton
kernels with their autograd Function, and one public function that dispatches
between them (see :func:`fractus.ops.common.pick`). The Kuramoto clock's reference is plain
autograd; its fast PyTorch path is a fused autograd Function with a hand-written RK4 backward.
"""
