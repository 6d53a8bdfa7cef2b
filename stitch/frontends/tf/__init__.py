"""The TensorFlow front end: ``tf_frontend`` (tf.function(jit_compile=True) and Keras' TF
trainer), ``tf_bridge`` (TF values to the stitched executable and back), ``host_conversions``,
and sharing one GPU with jax (``gpu_sharing``, ``cuda_libraries``)."""
