"""Metal kernel sources, shipped as package data and loaded by mlxkv.kernels."""
