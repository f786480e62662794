"""The prefill role: gRPC servicer and process main."""
