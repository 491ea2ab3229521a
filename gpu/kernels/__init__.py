"""Compute kernels: Triton (CUDA) and numba (CPU), apart from the models that call them."""
