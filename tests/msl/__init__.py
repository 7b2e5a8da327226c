"""The MSL execution harness: Metal kernels' generated source, run on the CPU."""
