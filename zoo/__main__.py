"""`python -m zoo ...` (what `torchrun --nproc-per-node N -m zoo generate ...` runs on each rank)."""
from .cli import run

run()
