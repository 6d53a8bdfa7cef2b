"""The GPU bring-up kit: what ``scripts/gpu_check.sh`` runs on a GPU machine (and, with
``--rehearse``, on a CPU machine so the kit cannot rot between GPU checks).

Steps (one module each, each a child process under ``timeout``; a failing or hanging step is
recorded and the next one runs):

``env``        device, driver, CUDA, jax/jaxlib, the ptxas and libdevice stitch uses, the
               target the pass plans for (``env.py``)
``smoke``      stitch's pass is called by XLA (STITCH_LOG=debug), through ``stitch.jit`` and
               through the ``STITCH_ENABLE=1`` autoload from a checkout on PYTHONPATH
               (``smoke.py``); fails loudly
``tests``      ``pytest tests/gpu`` (hand-written kernels and ``stitch.jit`` end to end on
               the device for zoo models against ``jax.jit``)
``tensor_cores`` stitch's GEMM-bound kernels (attention backward, LM-head backward, a GEMM
               chain) at real sizes: built on the device, checked against jax's vjp, timed,
               with XLA's time for the same math; their fraction of the tensor cores' peak
               calibrates ``stitch.cost.mma_efficiency`` (``tensor_cores.py``)
``timings``    whole steps under ``stitch.jit`` vs ``jax.jit`` (warm-up, medians), every
               stitched kernel's cubin and launch facts for the kernel steps, the
               latency-evaluator's prediction per kernel (``timings.py``)
``profile``    a perfetto trace of a few steps, stock and stitched: device µs per call by
               kernel, host dispatch per call (``profile.py``): where a stitched step's
               time goes
``kernels``    each stitched kernel timed on the device (``bench.opt_levels time``: CUDA
               graphs through ctypes), HBM bandwidth as a fraction of the device's peak
``sanitizer``  compute-sanitizer memcheck and racecheck over those kernels, and memcheck over
               a small stitched jax program (``XLA_PYTHON_CLIENT_ALLOCATOR=platform``)
``opt_levels`` the LLVM pipelines' kernels timed: a carried ``.gpu_bench`` (prepared here), or
               else one small model's prepared on the device (deviceless compile there)

``runner.py`` runs them and writes ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.md``;
``ingest.py`` (here, afterwards) turns the returned folder into docs/benchmarks.md's GPU
section and a calibration table under ``stitch/cost/calibration/``.
"""
