"""The gRPC front end of the engine: proto and stubs, servicer, server, client, Prometheus metrics, CLI."""
