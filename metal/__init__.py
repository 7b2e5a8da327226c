"""Metal kernel sources: the repository's metal/ folder, installed as package
data `mlxkv.metal` and loaded by mlxkv.attention.kernels."""
