"""What the gateway and both node roles share, below all of them: Prometheus metrics, tracing,
the engine <-> protobuf conversions, and the node base (gRPC server, lifecycle, load reports)."""
