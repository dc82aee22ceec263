"""raysparse.configs"""
