"""The gRPC API (splitserve.v1) and its generated stubs (interfaces issue)."""
