"""Code generation: Kernel IR (kir), its lowering from planned kernels and GEMM-chain,
attention-backward and LM-head generators, LLVM emission (NVPTX and host), ptxas, the compile
cache with crash-isolated build children, and the host (CPU) FFI targets used on machines
without a GPU."""
