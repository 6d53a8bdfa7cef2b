"""Framework front ends that are not jax.jit itself: ``tf`` (tf.function(jit_compile=True)
and Keras' TF trainer through the XLA pass). Imported on use; importing ``stitch.frontends``
pulls in no framework."""
