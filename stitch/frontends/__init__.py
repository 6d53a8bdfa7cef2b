"""The front ends over the XLA pass: what the jax and TensorFlow ones share (``switching``:
per signature, stock until the stitched build is ready, then the switch; ``verify`` and
``device_compare``: stitched against stock; ``job_decisions``: one decision per
multi-process job; ``size_gate``), and one subpackage each: ``jax`` (``stitch.jit``),
``tf`` (tf.function and Keras' TF trainer). Importing it imports no framework."""
