"""`python -m zoo ...` (what `torchrun --nproc-per-node N -m zoo generate ...` runs on each rank)."""
import sys

from .cli import main

sys.exit(main())
