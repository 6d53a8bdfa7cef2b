import sys

from bench.gpu_kit.runner import main

sys.exit(main())
