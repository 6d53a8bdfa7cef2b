"""The jax front end: ``jax_jit`` (``stitch.jit``) and the ``stitch demo`` command."""
