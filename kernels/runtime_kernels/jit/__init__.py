"""The Triton kernels themselves. Importing any module here imports Triton."""
