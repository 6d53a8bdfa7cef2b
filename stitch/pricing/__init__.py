"""Prices of planned kernels: the delta-evaluator (``delta``: a pattern's time against XLA's
kernels it replaces, with its tuned schedule), GEMM chains and fused LM-head losses at their
searched tilings (``chain_pricing``, ``lm_head_pricing``), and structure keys that share
prices between identical kernels (``structure``). Built on the device models (``cost``) and
the schedules (``schedule``); the explorer and the XLA pass price through it."""
