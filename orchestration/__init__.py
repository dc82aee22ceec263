"""raysparse.orchestration"""
