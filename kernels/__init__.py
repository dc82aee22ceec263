"""raysparse.kernels"""
