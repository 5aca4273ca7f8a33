"""``python -m torch_fastload.doctor``: the same as ``python -m torch_fastload doctor``."""

import sys

from .cli import main

sys.exit(main(prog="python -m torch_fastload.doctor"))
