"""Our own CUDA kernels: the tiled GEMM every matmul uses on the GPU, and its CPU emulator."""
