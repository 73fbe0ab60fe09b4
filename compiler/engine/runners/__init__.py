"""How the engine's steps execute, one module per runner: eager, compiled regions (dynamo),
AOTInductor packages, CUDA-graph replay. base.py holds the contract and the registry; importing
this package registers every runner in it, so a new runner is one new file here."""
from ...registry import register_folder
from .base import Runner, RunnerOptions, choose, register, runner_class, runner_kinds

__all__ = ["Runner", "RunnerOptions", "choose", "register", "runner_class", "runner_kinds"]

register_folder(__name__, __path__)
