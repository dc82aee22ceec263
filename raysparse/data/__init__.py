"""raysparse.data: Ray Data batch inference through raysparse engines (``processor``)."""
