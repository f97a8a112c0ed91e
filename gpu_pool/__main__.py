"""``python -m gpu_pool`` is ``ember pool`` (for cluster pods that run only the daemon)."""

import sys

from gpu_pool.cli import main

sys.exit(main(sys.argv[1:]))
