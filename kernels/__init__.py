"""CUDA C++ sources of ringcomm's GPU kernels, shipped as package data (ringcomm._kernels)."""
