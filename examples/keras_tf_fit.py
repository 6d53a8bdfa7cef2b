"""keras_fit.py on Keras' TensorFlow backend (no stitch import): KERAS_BACKEND is set to
tensorflow before Keras is imported (Keras then chooses `jit_compile` itself: "auto" runs the
step without XLA on a CPU-only host). Same options and output as keras_fit.py.

    python keras_tf_fit.py --steps 500
    python keras_tf_fit.py --seconds 30 --min-steps 50
"""
import os
import runpy
from pathlib import Path

os.environ["KERAS_BACKEND"] = "tensorflow"
runpy.run_path(str(Path(__file__).with_name("keras_fit.py")), run_name="__main__")
