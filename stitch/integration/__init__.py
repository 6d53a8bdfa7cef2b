"""The framework layer over the optimizer: stitch as an XLA pass (``xla_pass``: registered
and called back in ``pass_registration``, a compile's request in ``pass_request``, planning and
placing in ``pass_planning``, device builds in ``kernel_builds``; kernel snapping in ``snap``
and the module rewrite in ``hlo_rewrite``), ``stitch.jit`` on top of it
(``jax_jit``, with ``switching``, ``verify`` and ``config``), TensorFlow and Keras
(``tf_frontend``), env-var enablement (``autoload``), the demo, and end-to-end scenarios
(``scripts/``, tests). Importing it imports no framework."""
