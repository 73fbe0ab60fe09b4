"""Tensor and expert parallelism on torch.distributed: the mesh and its collectives (mesh.py),
the sharding plan each kind declares and its driver (plan.py)."""
