"""specwire: speculative decoding across two gRPC services."""

__version__ = "0.1.0"
