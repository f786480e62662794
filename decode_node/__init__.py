"""The decode role: gRPC servicer and process main."""
