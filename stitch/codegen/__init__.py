"""Kernel IR, LLVM emission (NVPTX and host), compile cache.

Empty until the code-generation issue lands; the package exists so the layout of the design
card (stitch/, stitch/hlo_passes/, stitch/codegen/) installs from the start.
"""
