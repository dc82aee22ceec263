"""raysparse.actors"""
